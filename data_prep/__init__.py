"""Dataset builders: conversation sources, chat-template tokenisation with loss masks,
regeneration of assistant turns by the target, and evaluation prompt sets.

Modules (each importable on its own; heavy libraries are imported lazily where a GPU
benchmark does not need them):

- :mod:`data_prep.sources`      ``load_conversations``, ``split_train_eval``, ``load_mixture`` (``data.mix``)
- :mod:`data_prep.kv_carry`     ``KVCarry`` (``regen.keep_kv``: the segmented engine keeps its KV cache)
- :mod:`data_prep.template`     ``tokenize_conversation``, ``build_prompt_ids``
- :mod:`data_prep.regenerate`   ``regenerate`` (HF ``generate``; dispatches ``regen.backend: vllm``)
- :mod:`data_prep.regenerate_vllm` ``regenerate_vllm`` (OpenAI-compatible server or offline ``vllm.LLM``)
- :mod:`data_prep.sharegpt`     ``iter_json_array`` (truncation-tolerant ShareGPT JSON stream reader)
- :mod:`data_prep.eval_prompts` ``load_eval_prompts``
"""
