"""``data.loop_tail: unsupervise`` through ``peagle-train prepare`` (the real SmolLM2 tokenizer, a chat JSONL
without regeneration): a looping answer loses its tail from the loss and the sequence, a fresh answer is
unchanged, and meta.json counts what was taken out; the default keeps everything."""
import json

import pytest
from conftest import need_smollm2

from peagle_train.cli import main
from peagle_train.features.tokenized import load_tokenized

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def test_prepare_unsupervises_looping_tails(tmp_path):
    need_smollm2()
    loop = "The cat sat on the mat. " * 60
    fresh = ("Paris is the capital of France. It lies on the Seine, has about two million inhabitants, and is "
             "known for the Louvre, the Eiffel Tower and its cafes; its region is the richest in the country.")
    rows = [{"messages": [{"role": "user", "content": "Tell me about a cat."}, {"role": "assistant", "content": loop}]},
            {"messages": [{"role": "user", "content": "What is Paris?"}, {"role": "assistant", "content": fresh}]}]
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["data.source=jsonl", f"data.path={src}", "data.num_conversations=2", "data.eval_fraction=0",
              "data.decontaminate=false", "regen.enabled=false", "--quiet"]
    runs = {}
    for policy in ("keep", "unsupervise"):
        out = tmp_path / policy
        assert main(["prepare", "recipes/smollm2-135m.yaml", f"output_dir={out}", f"data.loop_tail={policy}", *common]) == 0
        runs[policy] = (load_tokenized(out / "data" / "train.safetensors"),
                        json.loads((out / "data" / "meta.json").read_text())["splits"]["train"])
    (keep, meta_keep), (cut, meta_cut) = runs["keep"], runs["unsupervise"]
    assert "loop_tails" not in meta_keep
    lengths = sorted(zip(map(len, keep["input_ids"]), map(len, cut["input_ids"]), cut["loss_mask"]))
    (fresh_keep, fresh_cut, _), (loop_keep, loop_cut, looped) = lengths  # the loop is the longer one uncut
    assert fresh_cut == fresh_keep and loop_cut < loop_keep
    lt = meta_cut["loop_tails"]
    assert lt["sequences"] == 1 and lt["tokens_removed"] == loop_keep - loop_cut > 100
    assert lt["tokens_unsupervised"] == meta_keep["supervised_tokens"] - meta_cut["supervised_tokens"]
    assert lt["tokens_removed"] == lt["tokens_unsupervised"] + 1  # + the template's token after <|im_end|>
    assert meta_cut["tokens"] == meta_keep["tokens"] - lt["tokens_removed"]
    assert looped[-1] == 1 and sum(looped) >= 32  # ends on a supervised token; the loop's start is still learned
