"""Stand-in tokenizers of the real vocabulary size, special tokens and chat template of GPT-OSS and Llama-3.1.

The real tokenizers (GPT-OSS's ``o200k_harmony``, Llama-3.1's tiktoken-based BPE) cannot be read here:
their merge tables are downloaded at run time (``tiktoken`` and ``openai-harmony`` fetch the
``.tiktoken`` file from the network, and the Hub's ``tokenizer.json`` is not reachable). This module
builds a **stand-in**: a ``tokenizers`` byte-level BPE *without merges* (every UTF-8 byte is one token,
ids 0..255), padded with unreachable filler tokens up to the real tokenizer's first special id, then
the real special tokens at their real ids, so that

* the vocabulary size is exactly the real one (201,088 for GPT-OSS, 128,256 for Llama-3.1): embedding
  and head shapes, draft-vocabulary maps and the mask token id (``ptd_token_id`` 201020 for GPT-OSS,
  a reserved special token) are valid exactly as with the real tokenizer;
* the chat template is the model's real one (``peagle_train/data/chat_templates/``, with its source
  and licence in its header) and every special token it writes (``<|start|>``, ``<|channel|>``,
  ``<|message|>``, ``<|end|>``, ``<|return|>`` ...; ``<|begin_of_text|>``, ``<|start_header_id|>``,
  ``<|end_header_id|>``, ``<|eot_id|>``) is one token at its real id;
* any id a random-weight target generates decodes to text (a filler ``k`` decodes to ``<k>``).

What differs from the real tokenizer: ordinary text is split into bytes (about 4x more tokens per
word), so token counts, sequence lengths and acceptance are NOT the real model's. Use it only with a
random-weight target (``target.random_init_from_config``); see ``docs/real_shapes.md``.

CLI: ``python -m peagle_train.features.stand_in_tokenizer {gpt-oss,llama-3.1} OUT_DIR``.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"


@dataclass(frozen=True)
class StandInSpec:
    """What a stand-in copies from the real tokenizer.

    Attributes:
        vocab_size: the real vocabulary size (the model's ``vocab_size``).
        first_special: id of the first special token; ids 256..first_special-1 are fillers.
        named: real special tokens at their real ids (every other id >= first_special is
            ``reserved(id)``).
        bos, eos, pad: the tokenizer_config's ``bos_token``/``eos_token``/``pad_token``.
        template: file name under ``peagle_train/data/chat_templates/``.
        add_bos: whether the real tokenizer prepends ``bos`` when encoding with special tokens.
        source: where the ids were read.
    """

    vocab_size: int
    first_special: int
    named: dict = field(default_factory=dict)
    reserved: object = None
    bos: str | None = None
    eos: str = ""
    pad: str | None = None
    template: str = ""
    add_bos: bool = False
    source: str = ""


def _llama_reserved(i: int) -> str:
    # 128002, 128003 -> 0, 1; 128005 -> 2; 128011.. -> 3..247 (the real Llama-3 layout)
    return f"<|reserved_special_token_{ {128002: 0, 128003: 1, 128005: 2}.get(i, i - 128011 + 3) }|>"


SPECS = {
    "gpt-oss": StandInSpec(
        vocab_size=201088, first_special=199998,
        named={199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
               200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>",
               200012: "<|call|>"},
        reserved=lambda i: f"<|reserved_{i}|>",
        bos="<|startoftext|>", eos="<|return|>", pad="<|endoftext|>", template="gpt-oss.jinja", add_bos=False,
        source="o200k_harmony special tokens (openai-harmony / tiktoken); bos/eos/pad of openai/gpt-oss-20b's "
               "tokenizer_config.json and config.json (eos_token_id 200002, pad_token_id 199999)"),
    "llama-3.1": StandInSpec(
        vocab_size=128256, first_special=128000,
        named={128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128004: "<|finetune_right_pad_id|>",
               128006: "<|start_header_id|>", 128007: "<|end_header_id|>", 128008: "<|eom_id|>",
               128009: "<|eot_id|>", 128010: "<|python_tag|>"},
        reserved=_llama_reserved,
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, template="llama-3.1.jinja", add_bos=True,
        source="meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json (added_tokens_decoder; eos <|eot_id|>) "
               "and config.json (bos 128000, eos [128001, 128008, 128009])"),
}


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode map (what ``tokenizers``' ByteLevel uses), in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def special_tokens(kind: str) -> dict[int, str]:
    """``{id: token}`` of every special id of the stand-in (``first_special .. vocab_size-1``).

    Raises:
        ValueError: unknown ``kind`` (names the choices).
    """
    spec = _spec(kind)
    return {i: spec.named.get(i) or spec.reserved(i) for i in range(spec.first_special, spec.vocab_size)}


def _spec(kind: str) -> StandInSpec:
    if kind not in SPECS:
        raise ValueError(f"stand-in tokenizer '{kind}': unknown; choose one of {sorted(SPECS)}")
    return SPECS[kind]


def build_stand_in_tokenizer(kind: str, out_dir) -> Path:
    """Write a stand-in fast tokenizer folder (``tokenizer.json``, ``tokenizer_config.json``,
    ``chat_template.jinja``, ``STAND_IN.json``) for ``kind`` (``gpt-oss`` or ``llama-3.1``) to
    ``out_dir`` and return it; ``AutoTokenizer.from_pretrained(out_dir)`` loads it (``target.tokenizer``).

    Deterministic: the same ``kind`` always gives the same files. ``len(tokenizer) == vocab_size``.

    Raises:
        ValueError: unknown ``kind``.
        OSError: ``out_dir`` cannot be written.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    spec = _spec(kind)
    vocab = {c: i for i, c in enumerate(_byte_alphabet())}
    for i in range(256, spec.first_special):
        vocab[f"<{i}>"] = i  # fillers: printable ASCII (ByteLevel maps it to itself), never produced by encoding
    specials = special_tokens(kind)
    for i, tok in specials.items():
        vocab[tok] = i
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)])
    if spec.add_bos:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos} $B",
            special_tokens=[(spec.bos, vocab[spec.bos])])
    template = (TEMPLATES / spec.template).read_text()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=spec.bos, eos_token=spec.eos, pad_token=spec.pad,
                                   model_max_length=131072)
    fast.chat_template = template
    if len(fast) != spec.vocab_size:  # the whole point: a mismatch is a bug here
        raise AssertionError(f"stand-in {kind}: {len(fast)} tokens, expected {spec.vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    (out / "STAND_IN.json").write_text(json.dumps({
        "stand_in": kind, "vocab_size": spec.vocab_size, "special_ids_from": spec.source,
        "chat_template": f"peagle_train/data/chat_templates/{spec.template}",
        "note": "NOT the real tokenizer: byte-level, no merges, same vocabulary size and special token ids; "
                "for random-weight targets only (docs/real_shapes.md)"}, indent=1))
    return out


def main(argv=None) -> int:
    """CLI: ``python -m peagle_train.features.stand_in_tokenizer KIND OUT_DIR``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("kind", choices=sorted(SPECS))
    p.add_argument("out_dir")
    a = p.parse_args(argv)
    print(build_stand_in_tokenizer(a.kind, a.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
