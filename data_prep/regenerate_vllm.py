"""Regenerate every assistant turn with the target served by vLLM (``regen.backend: vllm``).

Two engines, chosen by ``regen.server_url``:

- **server** (``server_url`` set): an OpenAI-compatible server, e.g. ``vllm serve <model>``
  (any server implementing ``POST /v1/chat/completions`` and ``GET /v1/models``). Requests
  are sent with ``httpx``, ``regen.concurrency`` at a time. The server applies the model's
  chat template to the ``messages`` it receives.
- **offline** (``server_url`` unset): ``vllm.LLM(model).chat(...)`` in this process (vLLM is
  imported only here, lazily); one ``chat`` call per round, batched by vLLM itself.

Both engines run the HF backend's round loop (:func:`data_prep.rounds.run_rounds`): turns
are regenerated in rounds; round ``r`` sends, for every conversation still alive, ``system? + (user_1,
regenerated_1, ..., user_r)``, so turn ``r`` conditions on the *regenerated* history. The
prompt length is measured with the target tokenizer's own template
(:func:`data_prep.template.build_prompt_ids`); a prompt over ``max_prompt_tokens`` or an
empty response ends its conversation (kept with turns ``< r``, or dropped at ``r = 0``),
counted in the report, never raised. A reasoning field returned by the server
(``reasoning_content`` or ``reasoning``, from a vLLM reasoning parser) is stored as the
assistant message's ``reasoning`` (what :mod:`data_prep.template` renders) and is not sent
back in later turns' history.

Sampling: greedy (``temperature 0``, ``top_p 1``) unless ``regen.do_sample``; then
``regen.temperature``/``regen.top_p``. Every request carries ``seed = regen.seed`` (vLLM's
per-request seed), so sampled output is reproducible for the same server, model and inputs.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

from data_prep.config import RegenConfig
from data_prep.rounds import Completion, Job, Message, regen_report, run_rounds, split_turns

#: HTTP statuses retried (with ``regen.max_retries``) besides connection errors.
RETRY_STATUS = {429, 500, 502, 503, 504}


class ServerError(RuntimeError):
    """The OpenAI-compatible server could not be reached or answered an error; the message
    names the URL, the conversation/turn when known, and what to do."""


def _sampling(cfg: RegenConfig) -> dict:
    """OpenAI-style sampling fields from ``cfg`` (greedy → temperature 0, top_p 1)."""
    return {
        "temperature": cfg.temperature if cfg.do_sample else 0.0,
        "top_p": cfg.top_p if cfg.do_sample else 1.0,
        "max_tokens": cfg.max_new_tokens,
        "seed": cfg.seed,
    }


# --------------------------------------------------------------------------- server engine


class _ServerEngine:
    """Client for an OpenAI-compatible ``/v1/chat/completions`` endpoint.

    Args:
        cfg: ``server_url``, ``model_name`` (None = the server's only model, from
            ``GET /v1/models``), ``api_key_env``, ``concurrency``, ``request_timeout_s``,
            ``max_retries`` and the sampling fields.

    Raises:
        ServerError: server unreachable or answering an error at start-up (``/v1/models``),
            or several served models and no ``regen.model_name``.
        ValueError: ``regen.api_key_env`` names an unset environment variable.
    """

    def __init__(self, cfg: RegenConfig):
        import httpx

        self.cfg = cfg
        self.base = cfg.server_url.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[: -len("/v1")]
        headers = {}
        if cfg.api_key_env is not None:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise ValueError(
                    f"regen.api_key_env '{cfg.api_key_env}': environment variable is not set; export it "
                    f"with the API key of {cfg.server_url}, or remove regen.api_key_env"
                )
            headers["Authorization"] = f"Bearer {key}"
        self.client = httpx.Client(
            base_url=self.base, headers=headers, timeout=cfg.request_timeout_s,
            limits=httpx.Limits(max_connections=cfg.concurrency),
        )
        self.model = cfg.model_name or self._only_model()

    def _request(self, method: str, path: str, what: str, **kw) -> dict:
        """One HTTP request with retries; returns the decoded JSON body.

        Raises:
            ServerError: connection failure or HTTP error after ``max_retries`` retries, or
                a body that is not JSON; names ``what`` (e.g. the conversation and turn).
        """
        import httpx

        url = f"{self.base}{path}"
        for attempt in range(self.cfg.max_retries + 1):
            last = attempt == self.cfg.max_retries
            try:
                resp = self.client.request(method, path, **kw)
            except httpx.TransportError as e:
                if not last:
                    time.sleep(0.25 * 2**attempt)
                    continue
                raise ServerError(
                    f"regen.server_url: could not reach {url} for {what} ({type(e).__name__}: {e}); start an "
                    f"OpenAI-compatible server there (e.g. `vllm serve <model> --port <port>`) or fix "
                    f"regen.server_url"
                ) from e
            if resp.status_code in RETRY_STATUS and not last:
                time.sleep(0.25 * 2**attempt)
                continue
            if resp.status_code != 200:
                raise ServerError(
                    f"{url} answered HTTP {resp.status_code} for {what} after {attempt + 1} attempt(s): "
                    f"{resp.text[:500]!r}; check the server log, regen.model_name and regen.api_key_env"
                )
            try:
                return resp.json()
            except ValueError as e:
                raise ServerError(f"{url} answered {what} with a body that is not JSON: {resp.text[:200]!r}") from e
        raise AssertionError("unreachable")

    def _only_model(self) -> str:
        body = self._request("GET", "/v1/models", "the model list")
        ids = [m.get("id") for m in body.get("data", []) if isinstance(m, dict)]
        if len(ids) != 1:
            raise ServerError(
                f"{self.base}/v1/models lists {len(ids)} models {ids}; set regen.model_name to the one to use"
            )
        return ids[0]

    def _one(self, k: int, r: int, messages: list[Message]) -> Completion:
        what = f"conversation {k}, turn {r}"
        body = self._request(
            "POST", "/v1/chat/completions", what,
            json={"model": self.model, "messages": messages, "n": 1, **_sampling(self.cfg)},
        )
        try:
            choice = body["choices"][0]
            msg = choice["message"]
            text = msg.get("content") or ""
            reasoning = msg.get("reasoning_content") or msg.get("reasoning") or None
            usage = body.get("usage") or {}
            tokens = int(usage["completion_tokens"])
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ServerError(
                f"{self.base}/v1/chat/completions: unexpected response for {what} (missing {e}); expected "
                f"choices[0].message.content and usage.completion_tokens: {str(body)[:300]}"
            ) from e
        return Completion(text.strip(), reasoning.strip() if reasoning else None, tokens,
                          choice.get("finish_reason") != "length")

    def __call__(self, jobs: list[Job]) -> list[tuple[int, Completion]]:
        """Complete ``(conversation index, turn, messages, prompt ids)`` jobs, ``concurrency`` at a
        time; returns ``(job position, Completion)`` in job order."""
        with ThreadPoolExecutor(max_workers=self.cfg.concurrency) as pool:
            return list(enumerate(pool.map(lambda j: self._one(*j[:3]), jobs)))

    def close(self) -> None:
        self.client.close()


# --------------------------------------------------------------------------- offline engine


def import_vllm():
    """Import :mod:`vllm` (lazily: it is heavy and optional).

    Raises:
        ImportError: vLLM is not installed; says what to install or set instead.
    """
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            f"regen.backend: vllm without regen.server_url runs vllm.LLM offline, but vLLM cannot be imported "
            f"({e}); install it (`pip install vllm`, needs a CUDA GPU), or set regen.server_url to an "
            f"OpenAI-compatible server (e.g. `vllm serve <model>`), or set regen.backend: hf"
        ) from e
    return vllm


@lru_cache(maxsize=1)
def _load_llm(model: str, seed: int):
    """One ``vllm.LLM`` per process (reused across regeneration shards)."""
    return import_vllm().LLM(model=model, seed=seed)


class _OfflineEngine:
    """``vllm.LLM(model).chat`` on a whole round at once.

    Raises:
        ImportError: vLLM missing (:func:`import_vllm`).
        ValueError: no model name (``regen.model_name`` unset and the target has no ``name_or_path``).
    """

    def __init__(self, cfg: RegenConfig, model, progress: bool):
        name = cfg.model_name or getattr(model, "name_or_path", None)
        vllm = import_vllm()
        if not name:
            raise ValueError(
                "regen.backend: vllm (offline) needs the target's model path or Hub id: set regen.model_name"
            )
        self.model, self.progress = name, progress
        self.llm = _load_llm(name, cfg.seed)
        self.params = vllm.SamplingParams(n=1, **_sampling(cfg))

    def __call__(self, jobs: list[Job]) -> list[tuple[int, Completion]]:
        """One ``chat`` call for the whole round; ``(job position, Completion)`` in job order."""
        outs = self.llm.chat([j[2] for j in jobs], self.params, use_tqdm=self.progress)
        return [(i, Completion(o.outputs[0].text.strip(), None, len(o.outputs[0].token_ids),
                               o.outputs[0].finish_reason != "length")) for i, o in enumerate(outs)]

    def close(self) -> None:
        pass


def regenerate_vllm(
    model,
    tokenizer,
    conversations: list[list[Message]],
    cfg: RegenConfig,
    max_prompt_tokens: int,
    progress: bool = True,
) -> tuple[list[list[Message]], dict]:
    """Replace every assistant turn by the target's response, generated by vLLM.

    Args:
        model: the HF target (only its ``name_or_path`` is used, as the offline model when
            ``regen.model_name`` is unset); may be None with a server.
        tokenizer: the target tokenizer with its chat template (prompt-length check).
        conversations: normal-form conversations (:mod:`data_prep.sources`); assistant
            contents are ignored, a trailing user message is answered too.
        cfg: ``backend == "vllm"``; ``server_url`` selects the engine (module docstring).
        max_prompt_tokens: a prompt (tokens, with the assistant header) longer than this
            ends its conversation (counted).
        progress: tqdm bar (turns, generated tokens/s).

    Returns:
        ``(conversations, report)`` with the keys of the HF backend's report
        (:func:`data_prep.regenerate.regenerate`; ``eos_token_ids`` is None: the engine
        decides) plus ``engine`` (``server``/``offline``), ``server_url``, ``model`` and
        ``concurrency``.

    Raises:
        ValueError: ``cfg.enabled`` false, ``cfg.backend`` not ``vllm``, a conversation not in
            normal form, ``api_key_env`` unset in the environment, no offline model name.
        ServerError: server unreachable or answering an error (names URL, conversation, turn).
        ImportError: offline engine without vLLM installed (says what to install or set).
    """
    if cfg.backend != "vllm":
        raise ValueError(f"regenerate_vllm needs regen.backend: vllm (got '{cfg.backend}')")
    if not cfg.enabled:
        raise ValueError("regen.enabled is false: skip regenerate() and keep the source responses")

    for k, c in enumerate(conversations):  # fail on a bad row before contacting any engine
        split_turns(c, k)
    engine = _ServerEngine(cfg) if cfg.server_url else _OfflineEngine(cfg, model, progress)
    try:
        kept, stats = run_rounds(engine, tokenizer, conversations, max_prompt_tokens, progress,
                                 desc="regenerate (vllm)")
    finally:
        engine.close()
    head = {"backend": "vllm", "engine": "server" if cfg.server_url else "offline", "server_url": cfg.server_url,
            "model": engine.model, "concurrency": cfg.concurrency if cfg.server_url else None}
    report = regen_report(cfg, head, **{**stats, "looped": None}, max_prompt_tokens=max_prompt_tokens, eos_ids=None)
    return kept, report
