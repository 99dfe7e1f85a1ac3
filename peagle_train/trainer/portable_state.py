"""A compact, portable training state: one file that lets a run continue on a fresh machine.

A checkpoint folder (``accelerate.save_state``) is tied to its run folder and holds everything;
the portable state holds exactly what a resume needs and nothing that can be rebuilt:

* the trainable weights (fp32, as trained) -- never the frozen target, its embeddings copy or head
  rows that are not trained, a feature cache or the prepared data (rebuilt or carried separately);
* the AdamW moments (``train.state_moments``: ``bf16``, the default, halves their size; ``fp32`` resumes
  bit-exactly),
  per-parameter step counts and the param groups (lr, betas, ...);
* the LR scheduler's state, the optimizer step, the RNG states of every rank (torch, CUDA,
  numpy, random) and the history so far (the learning curve continues);
* the data position: the epoch order is a seeded shuffle (``epoch_order(n, seed, epoch)``), so
  the step and ``train.seed`` (compared through the fingerprint) place the run in its data.

File layout (``FORMAT``): ``MAGIC`` (8 bytes), the JSON header's length (8 bytes, little endian),
the JSON header, then a safetensors payload whose sha256 the header holds. The header also holds
the run's *fingerprint*: the recipe keys that decide the trained numbers (``target.*`` but its
path, ``drafter.*``, ``train.*`` but launch-only keys, ``data.cache_dtype``), the target's shape
and the prepared train split's sha256; a resume from a file of another recipe, target or data is
refused naming every difference. Written atomically (temp file + ``os.replace``). With
``train.state_part_mib`` a file larger than that is split into ``FILE.<sha8>.partI`` pieces and
``FILE`` is a small JSON manifest listing them (sizes, sha256), written last.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import random
import struct
import time
from pathlib import Path

import torch

from peagle_train.core.atomic import write_bytes_atomic
from peagle_train.core.config import ConfigError

MAGIC = b"PEAGLEST"
FORMAT = "peagle-train-state/1"
PARTS_FORMAT = "peagle-train-state-parts/1"

#: ``train.*`` keys that change nothing a resume reproduces (where and how often things are
#: written, logging, profiling, host-side prefetch, the in-training eval): not part of the fingerprint.
LAUNCH_ONLY_TRAIN_KEYS = frozenset({
    "state_in", "state_out", "state_moments", "state_part_mib", "save_every", "keep_last", "log_every",
    "prefetch", "profile_steps", "profile_start", "report_to", "eval_every", "eval_sequences", "eval_walk_sets",
    "gc_every", "compile_cache",
    "prefix_kernel_options",  # FlexAttention's block sizes for this GPU: how the prefix part runs, not what
    "prefix_compiled_apart"})  # whether the prefix kernel is compiled inside the layers' graphs: how, not what
#: ``target.*`` keys that may differ between machines (where the model lies): the target's shape is compared instead.
MACHINE_TARGET_KEYS = frozenset({"path", "tokenizer"})


class StateError(ConfigError):
    """A portable state that cannot be used: damaged (checksum, truncated, missing part) or made for another run."""


# -- fingerprint ----------------------------------------------------------------------------------
def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def data_sha256(input_ids, loss_mask) -> str:
    """sha256 of a prepared split as the trainer reads it: per sequence its length, int32 token ids
    and uint8 loss mask. ``input_ids`` / ``loss_mask``: lists of int lists of equal lengths."""
    h = hashlib.sha256()
    h.update(torch.tensor([len(x) for x in input_ids], dtype=torch.int64).numpy().tobytes())
    h.update(torch.tensor(list(itertools.chain.from_iterable(input_ids)), dtype=torch.int32).numpy().tobytes())
    h.update(torch.tensor(list(itertools.chain.from_iterable(loss_mask)), dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_fingerprint(cfg, target_config, train_ids, train_masks) -> dict:
    """What a portable state must match to be resumed: ``{"keys": {dotted key: value}, "sha256": str}``.

    ``keys`` holds the recipe keys that decide the trained numbers (``target.*`` but
    :data:`MACHINE_TARGET_KEYS`, ``drafter.*``, ``train.*`` but :data:`LAUNCH_ONLY_TRAIN_KEYS`,
    ``data.cache_dtype``), the target's shape (``target_config.*``: model type, hidden size, layers,
    heads, vocab) and ``data.train_sha256`` (:func:`data_sha256` of the sequences trained on).
    """
    dump = cfg.model_dump(mode="json")
    keys = {f"target.{k}": v for k, v in _flatten(dump["target"]).items() if k not in MACHINE_TARGET_KEYS}
    keys.update({f"drafter.{k}": v for k, v in _flatten(dump["drafter"]).items()})
    keys.update({f"train.{k}": v for k, v in _flatten(dump["train"]).items()
                 if k.split(".")[0] not in LAUNCH_ONLY_TRAIN_KEYS})  # a dict-valued key flattens to "key.name"
    keys["data.cache_dtype"] = dump["data"].get("cache_dtype")
    for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size"):
        keys[f"target_config.{k}"] = getattr(target_config, k, None)
    keys["data.train_sha256"] = data_sha256(train_ids, train_masks)
    blob = json.dumps(keys, sort_keys=True, default=str).encode()
    return {"keys": keys, "sha256": hashlib.sha256(blob).hexdigest()}


def recipe_defaults(cfg) -> dict:
    """``{dotted key: default}`` of the recipe keys a fingerprint holds (``target.*``, ``drafter.*``, ``train.*``
    with a default, JSON values as ``model_dump(mode="json")`` writes them, dict defaults flattened) -- what a
    state written before a key existed was trained with."""
    from pydantic_core import PydanticUndefined, to_jsonable_python

    out = {}
    for section in ("target", "drafter", "train"):
        for name, field in type(getattr(cfg, section)).model_fields.items():
            default = field.get_default(call_default_factory=True)
            if default is PydanticUndefined:
                continue
            value = to_jsonable_python(default)
            if isinstance(value, dict):
                out.update({f"{section}.{k}": v for k, v in _flatten(value, f"{name}.").items()})
            else:
                out[f"{section}.{name}"] = value
    return out


def fingerprint_differences(saved: dict, current: dict, defaults: dict | None = None) -> list[str]:
    """``"key: state X, this run Y"`` for every fingerprint key whose value differs (sorted by key).

    ``defaults`` (:func:`recipe_defaults`): a key the saved fingerprint lacks (added to the recipe schema after
    the state was written, e.g. ``train.depth_weights``) counts as equal where this run leaves it at its
    default, the behaviour the state was trained with; set to another value it is a difference (as
    :func:`peagle_train.stages.stamp_differences` treats a run folder's stamp)."""
    a, b, defaults = saved.get("keys", {}), current["keys"], defaults or {}
    absent = "<absent>"
    return [f"{k}: state {a.get(k, absent)!r}, this run {b.get(k, absent)!r}"
            for k in sorted(set(a) | set(b)) if a.get(k, absent) != b.get(k, absent)
            and not (k not in a and k in defaults and b.get(k, absent) == defaults[k])]


# -- file I/O ---------------------------------------------------------------------------------------
def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_state_file(path: str | Path, header: dict, tensors: dict[str, torch.Tensor],
                     max_part_mib: float | None = None) -> dict:
    """Write one portable state atomically; returns ``{"path", "bytes", "sha256", "parts"}``.

    Args:
        path: the file (its folder is created). header: JSON-serialisable dict (``payload_sha256``
            and ``payload_bytes`` are added). tensors: name -> CPU tensor (any dtype safetensors takes).
        max_part_mib: when the whole file is larger than this many MiB, write it as pieces
            ``<path>.<sha8>.part0..N`` of at most that size and make ``path`` a JSON manifest
            (``PARTS_FORMAT``: each piece's name, bytes and sha256, and the whole file's sha256),
            written after the pieces; pieces of an earlier write not listed are then removed.

    Raises:
        OSError: the folder is not writable (an earlier complete ``path`` is left as it was).
    """
    from safetensors.torch import save

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    header = {**header, "payload_sha256": _sha(payload), "payload_bytes": len(payload)}
    head = json.dumps(header).encode()
    blob = MAGIC + struct.pack("<Q", len(head)) + head + payload
    whole_sha = _sha(blob)
    parts: list[Path] = []
    limit = None if max_part_mib is None else int(max_part_mib * 2**20)
    if limit is not None and len(blob) > limit:
        for i, start in enumerate(range(0, len(blob), limit)):
            part = path.with_name(f"{path.name}.{whole_sha[:8]}.part{i}")
            write_bytes_atomic(part, blob[start:start + limit])
            parts.append(part)
        manifest = {"format": PARTS_FORMAT, "bytes": len(blob), "sha256": whole_sha,
                    "parts": [{"name": p.name, "bytes": p.stat().st_size, "sha256": _sha(blob[i * limit:(i + 1) * limit])}
                              for i, p in enumerate(parts)]}
        write_bytes_atomic(path, json.dumps(manifest, indent=1).encode())
    else:
        write_bytes_atomic(path, blob)
    keep = {p.name for p in parts}
    for old in path.parent.glob(f"{path.name}.*.part*"):  # pieces of an earlier write
        if old.name not in keep:
            old.unlink(missing_ok=True)
    return {"path": str(path), "bytes": len(blob), "sha256": whole_sha, "parts": [str(p) for p in parts]}


def read_state_bytes(path: str | Path) -> bytes:
    """The whole state file's bytes: ``path`` itself, or its pieces joined when ``path`` is a manifest.

    Raises:
        StateError: the file or a listed piece is missing, a piece's or the whole's sha256 differs.
    """
    path = Path(path)
    if not path.is_file():
        raise StateError(f"{path}: no such portable state file")
    data = path.read_bytes()
    if data[:1] != b"{":
        return data
    try:
        man = json.loads(data)
    except ValueError:
        raise StateError(f"{path}: neither a portable state nor a manifest of its parts (damaged?)") from None
    if man.get("format") != PARTS_FORMAT:
        raise StateError(f"{path}: manifest format {man.get('format')!r}, expected {PARTS_FORMAT!r}")
    chunks = []
    for p in man["parts"]:
        part = path.with_name(p["name"])
        if not part.is_file():
            raise StateError(f"{path}: part {part} is missing (copy every {path.name}.*.part* file listed in "
                             f"{path.name} beside it)")
        b = part.read_bytes()
        if len(b) != p["bytes"] or _sha(b) != p["sha256"]:
            raise StateError(f"{path}: part {part.name} fails its checksum (sha256 {_sha(b)[:16]}..., "
                             f"{len(b)} bytes; manifest {p['sha256'][:16]}..., {p['bytes']} bytes): damaged or "
                             "from another write")
        chunks.append(b)
    blob = b"".join(chunks)
    if _sha(blob) != man["sha256"]:
        raise StateError(f"{path}: the joined parts fail the manifest's sha256")
    return blob


def join_parts(path: str | Path, out: str | Path) -> Path:
    """Reassemble a split state (``path``: its manifest) into one file ``out`` (atomically), checked.

    Raises:
        StateError: as :func:`read_state_bytes`.
    """
    out = Path(out)
    write_bytes_atomic(out, read_state_bytes(path))
    return out


def read_state_file(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read and verify a portable state (single file or manifest of parts): ``(header, tensors)``.

    Raises:
        StateError: missing or truncated file, wrong magic or format, a payload whose sha256 differs
            from the header's (a corrupted file), or a missing / damaged part.
    """
    from safetensors.torch import load

    blob = read_state_bytes(path)
    if blob[:8] != MAGIC or len(blob) < 16:
        raise StateError(f"{path}: not a peagle-train portable state (bad magic)")
    (n,) = struct.unpack("<Q", blob[8:16])
    try:
        header = json.loads(blob[16:16 + n])
    except ValueError:
        raise StateError(f"{path}: its JSON header is damaged") from None
    if header.get("format") != FORMAT:
        raise StateError(f"{path}: format {header.get('format')!r}, this version reads {FORMAT!r}")
    payload = blob[16 + n:]
    if len(payload) != header.get("payload_bytes") or _sha(payload) != header.get("payload_sha256"):
        raise StateError(f"{path}: checksum mismatch (payload sha256 {_sha(payload)[:16]}..., {len(payload)} bytes; "
                         f"header says {str(header.get('payload_sha256'))[:16]}..., {header.get('payload_bytes')} "
                         "bytes): the file is damaged or truncated; copy it again")
    return header, load(payload)


def peek_step(path: str | Path) -> int | None:
    """The optimizer step a state file (or manifest) holds, from its header alone; None if unreadable."""
    try:
        path = Path(path)
        with open(path, "rb") as f:
            first = f.read(16)
            if first[:1] == b"{":  # a manifest: the header is at the start of part 0
                man = json.loads(path.read_bytes())
                with open(path.with_name(man["parts"][0]["name"]), "rb") as g:
                    first = g.read(16)
                    head = g.read(struct.unpack("<Q", first[8:16])[0])
            else:
                head = f.read(struct.unpack("<Q", first[8:16])[0])
        return int(json.loads(head)["step"])
    except (OSError, ValueError, KeyError, IndexError, struct.error):
        return None


# -- RNG ------------------------------------------------------------------------------------------------
def _rng_capture() -> tuple[dict, dict[str, torch.Tensor]]:
    """This process's RNG states: (JSON part, tensor part)."""
    import numpy as np

    meta: dict = {"python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]]}
    tensors = {"torch": torch.get_rng_state()}
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    meta["numpy"] = [kind, int(pos), int(has_gauss), float(cached)]
    tensors["numpy_keys"] = torch.from_numpy(keys.astype(np.int64))
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = s
        meta["cuda_devices"] = torch.cuda.device_count()
    return meta, tensors


def _rng_restore(meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    import numpy as np

    v, st, gauss = meta["python"]
    random.setstate((v, tuple(st), gauss))
    torch.set_rng_state(tensors["torch"])
    kind, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    if torch.cuda.is_available() and meta.get("cuda_devices"):
        n = min(meta["cuda_devices"], torch.cuda.device_count())
        torch.cuda.set_rng_state_all([tensors[f"cuda{i}"] for i in range(n)])


# -- the trainer side ---------------------------------------------------------------------------------
def _check_layout(trainer) -> None:
    if trainer.layout.strategy not in ("single", "ddp"):
        raise ConfigError(f"{trainer.cfg.source_file or '<recipe>'}: train.state_out / train.state_in need a "
                          f"single-process or DDP launch (this one is {trainer.layout.strategy}: the optimizer state "
                          "is sharded); carry the checkpoints/ folder instead")


def _named_trainables(trainer) -> dict[str, torch.nn.Parameter]:
    model = trainer.acc.unwrap_model(trainer.model)
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def state_tensors_and_header(trainer, moments: str = "bf16") -> tuple[dict, dict[str, torch.Tensor]]:
    """Collect the trainer's portable state (call on every rank; only rank 0's result is complete).

    Returns:
        ``(header, tensors)``: tensors ``param/<name>`` (fp32 trainable weights, their shapes),
        ``exp_avg/<name>`` and ``exp_avg_sq/<name>`` (AdamW moments in ``moments`` dtype: ``bf16``
        or ``fp32``), ``rng/rank<r>/<kind>`` (uint8 torch/CUDA states, int64 numpy keys); the
        header: step, total_steps, world size, strategy, param groups, per-parameter AdamW step,
        scheduler state, history, RNG JSON parts, fingerprint.

    Raises:
        ConfigError: an FSDP2 / DeepSpeed launch (sharded optimizer state). ValueError: ``moments``
            is not ``bf16`` / ``fp32``.
    """
    _check_layout(trainer)
    if moments not in ("bf16", "fp32"):
        raise ValueError(f"moments must be 'bf16' or 'fp32' (got {moments!r})")
    mdtype = torch.bfloat16 if moments == "bf16" else torch.float32
    named = _named_trainables(trainer)
    opt = trainer.opt.optimizer if hasattr(trainer.opt, "optimizer") else trainer.opt
    osd = opt.state_dict()
    id_to_name = {id(p): n for n, p in named.items()}
    index_to_name = {}
    flat_params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(flat_params):
        if id(p) in id_to_name:
            index_to_name[i] = id_to_name[id(p)]
    tensors = {f"param/{n}": p.detach().float().cpu() for n, p in named.items()}
    adam_steps = {}
    for i, st in osd["state"].items():
        n = index_to_name.get(i)
        if n is None:
            continue
        tensors[f"exp_avg/{n}"] = st["exp_avg"].detach().to("cpu", mdtype)
        tensors[f"exp_avg_sq/{n}"] = st["exp_avg_sq"].detach().to("cpu", mdtype)
        adam_steps[n] = float(st["step"])
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index_to_name.get(i) for i in g["params"]]}
              for g in osd["param_groups"]]
    meta, rng = _rng_capture()
    world = trainer.acc.num_processes
    if world > 1:
        import torch.distributed as dist

        gathered: list = [None] * world
        dist.all_gather_object(gathered, (meta, {k: v.cpu() for k, v in rng.items()}))
    else:
        gathered = [(meta, rng)]
    rng_meta = []
    for r, (m, t) in enumerate(gathered):
        rng_meta.append(m)
        tensors.update({f"rng/rank{r}/{k}": v for k, v in t.items()})
    sched = trainer.sched.scheduler if hasattr(trainer.sched, "scheduler") else trainer.sched
    header = {"format": FORMAT, "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "step": trainer.step, "total_steps": trainer.total_steps, "world_size": world,
              "strategy": trainer.layout.strategy, "moments": moments, "param_groups": groups,
              "adam_steps": adam_steps, "scheduler": sched.state_dict(), "rng": rng_meta,
              "history": trainer.history, "fingerprint": trainer.state_fingerprint()}
    return header, tensors


def save_portable_state(trainer, path: str | Path, moments: str = "bf16", max_part_mib: float | None = None) -> dict | None:
    """Write the trainer's portable state to ``path`` (rank 0 writes; call on every rank).

    Returns:
        on rank 0 :func:`write_state_file`'s result plus ``step``, ``moments`` and ``seconds``; None elsewhere.

    Raises:
        ConfigError: an FSDP2 / DeepSpeed launch.
    """
    t0 = time.perf_counter()
    header, tensors = state_tensors_and_header(trainer, moments)
    res = None
    if trainer.acc.is_main_process:
        res = write_state_file(path, header, tensors, max_part_mib)
        res.update(step=trainer.step, moments=moments, seconds=round(time.perf_counter() - t0, 3))
        parts = f" in {len(res['parts'])} parts" if res["parts"] else ""
        trainer.acc.print(f"portable state: {path} (step {trainer.step}, {res['bytes'] / 2**20:.2f} MiB{parts}, "
                          f"{moments} moments)")
    trainer.acc.wait_for_everyone()
    return res


def load_portable_state(trainer, path: str | Path) -> dict:
    """Load a portable state into a freshly built trainer (call on every rank); returns the header.

    Sets the trainable weights, the AdamW state (moments cast back to the parameters' dtype),
    the scheduler, this rank's RNG states, ``step``, ``history`` and ``elapsed_before``.

    Raises:
        StateError: damaged file (:func:`read_state_file`); a state of another run: its fingerprint
            differs (every differing key named with both values; a key newer than the state counts as equal
            at its default, :func:`fingerprint_differences`), another world size, or trainable
            parameters of other names / shapes (the drafter's shape).
        ConfigError: an FSDP2 / DeepSpeed launch.
    """
    _check_layout(trainer)
    header, tensors = read_state_file(path)
    diffs = fingerprint_differences(header.get("fingerprint", {}), trainer.state_fingerprint(),
                                    recipe_defaults(trainer.cfg))
    if diffs:
        raise StateError(f"{path} was written by another run and cannot be resumed here: " + "; ".join(diffs)
                         + ". Resume with the recipe (and prepared data) it was written with, or start a fresh run")
    world = trainer.acc.num_processes
    if header["world_size"] != world:
        raise StateError(f"{path} was written by {header['world_size']} processes but this launch has {world}: "
                         f"relaunch with {header['world_size']} processes (each rank's data and RNG are restored)")
    named = _named_trainables(trainer)
    saved = {k[len("param/"):]: v for k, v in tensors.items() if k.startswith("param/")}
    problems = [f"{n}: missing from the state" for n in named if n not in saved]
    problems += [f"{n}: in the state, not trainable here" for n in saved if n not in named]
    problems += [f"{n}: state {tuple(saved[n].shape)}, this drafter {tuple(p.shape)}"
                 for n, p in named.items() if n in saved and saved[n].shape != p.shape]
    if problems:
        raise StateError(f"{path}: its trainable parameters do not fit this drafter: " + "; ".join(problems[:8])
                         + ("; ..." if len(problems) > 8 else ""))
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(saved[n].to(p.device, p.dtype))
    opt = trainer.opt.optimizer if hasattr(trainer.opt, "optimizer") else trainer.opt
    osd = opt.state_dict()
    flat_params = [p for g in opt.param_groups for p in g["params"]]
    name_of = {id(p): n for n, p in named.items()}
    state = {}
    for i, p in enumerate(flat_params):
        n = name_of.get(id(p))
        if n is not None and f"exp_avg/{n}" in tensors:
            state[i] = {"step": torch.tensor(header["adam_steps"][n], dtype=torch.float32),
                        "exp_avg": tensors[f"exp_avg/{n}"].to(p.device, p.dtype),
                        "exp_avg_sq": tensors[f"exp_avg_sq/{n}"].to(p.device, p.dtype)}
    if len(header["param_groups"]) != len(osd["param_groups"]):
        raise StateError(f"{path}: {len(header['param_groups'])} optimizer param groups, this run "
                         f"{len(osd['param_groups'])}")
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": cur["params"]}
              for g, cur in zip(header["param_groups"], osd["param_groups"])]
    for g in groups:  # JSON turned tuples into lists
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    opt.load_state_dict({"state": state, "param_groups": groups})
    sched = trainer.sched.scheduler if hasattr(trainer.sched, "scheduler") else trainer.sched
    sched.load_state_dict(header["scheduler"])
    rank = trainer.acc.process_index
    prefix = f"rng/rank{rank}/"
    _rng_restore(header["rng"][rank], {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
    trainer.step, trainer.history = int(header["step"]), header["history"]
    trainer.elapsed_before = float(trainer.history[-1].get("elapsed_s", 0.0)) if trainer.history else 0.0
    trainer.acc.print(f"resumed from portable state {path} (step {trainer.step}, {header['moments']} moments)")
    return header


def state_size_bytes(n_trainable: int, moments: str = "bf16") -> int:
    """Approximate payload bytes of a state for ``n_trainable`` parameters: fp32 weights + two moments
    (2 or 4 bytes each); headers, RNG and history add a few KB to a few MB (the history's length)."""
    return n_trainable * (4 + 2 * (2 if moments == "bf16" else 4))


def recipe_state_size(cfg) -> dict:
    """Trainable parameters of a recipe's drafter and its portable state's size, without a GPU or weights.

    Reads the target's config alone (:func:`~peagle_train.features.target.load_target_config`; a GGUF
    target is de-quantised once, as the ``train`` stage does) and builds the drafter on the meta device. The draft vocabulary is ``drafter.draft_vocab_size`` (the
    full target vocab when unset).

    Returns:
        ``{"trainable": int, "embed_tokens": int, "lm_head": int, "target_tied_embeddings": bool,
        "bytes": {"fp32": int, "bf16": int}, "bytes_embed_frozen": {...}}``: every drafter parameter is
        trained; ``bytes_embed_frozen`` is what the state would be if ``embed_tokens`` were frozen.

    Raises:
        TargetLoadError: the target's config cannot be read (as the ``train`` stage would).
    """
    from peagle_train.features.target import default_aux_layer_ids, load_target_config
    from peagle_train.methods import get_method
    from peagle_train.model.drafter import Drafter, make_drafter_config

    _, tconf = load_target_config(cfg.target)
    aux = cfg.target.aux_layer_ids or default_aux_layer_ids(tconf.num_hidden_layers)
    shape = cfg.drafter.shape_fields()
    dcfg = make_drafter_config(tconf, aux_layer_ids=aux, draft_vocab_size=cfg.drafter.draft_vocab_size or tconf.vocab_size,
                               K=cfg.train.K, **shape, **get_method(cfg.train.method).drafter_fields(cfg))
    with torch.device("meta"):
        drafter = Drafter(dcfg)
    sizes = {n: p.numel() for n, p in drafter.named_parameters() if p.requires_grad}
    n = sum(sizes.values())
    embed = sum(v for k, v in sizes.items() if k.startswith("embed_tokens"))
    head = sum(v for k, v in sizes.items() if k.startswith("lm_head"))
    return {"trainable": n, "embed_tokens": embed, "lm_head": head,
            "target_tied_embeddings": bool(getattr(tconf, "tie_word_embeddings", False)),
            "bytes": {m: state_size_bytes(n, m) for m in ("fp32", "bf16")},
            "bytes_embed_frozen": {m: state_size_bytes(n - embed, m) for m in ("fp32", "bf16")}}
