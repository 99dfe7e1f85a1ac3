"""Draft methods behind one seam (:mod:`peagle_train.methods.base`): P-EAGLE and the EAGLE-3 baseline,
registered by name (``train.method``). Importing this package registers the built-in methods."""
from peagle_train.methods import eagle3, peagle  # noqa: F401  (registers the built-in methods)
from peagle_train.methods.base import (DraftMethod, get_method, method_names, method_of_config, register_method,
                                       unregister_method)

__all__ = ["DraftMethod", "get_method", "method_names", "method_of_config", "register_method", "unregister_method"]
