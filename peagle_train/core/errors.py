"""Errors that stop a run for a reason the user can act on, shared by the stage that raises them and
the console script that turns them into exit code 2 (``peagle_train.cli``)."""
from __future__ import annotations


class SkippedStepsError(RuntimeError):
    """More optimizer steps of a run were skipped (non-finite loss or grad norm) than
    ``train.max_skipped_steps`` allows; the message names the steps, the key and what to check."""
