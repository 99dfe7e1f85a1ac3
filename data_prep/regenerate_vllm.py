"""Regenerate every assistant turn with the target served by vLLM (``regen.backend: vllm``).

Two engines, chosen by ``regen.server_url``:

- **server** (``server_url`` set): an OpenAI-compatible server, e.g. ``vllm serve <model>``
  (any server implementing ``POST /v1/chat/completions`` and ``GET /v1/models``). Requests
  are sent with ``httpx``, ``regen.concurrency`` at a time. The server applies the model's
  chat template to the ``messages`` it receives.
- **offline** (``server_url`` unset): ``vllm.LLM(model).chat(...)`` in this process (vLLM is
  imported only here, lazily); one ``chat`` call per round, batched by vLLM itself.

Semantics match the HF backend (:mod:`data_prep.regenerate`): turns are regenerated in
rounds; round ``r`` sends, for every conversation still alive, ``system? + (user_1,
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
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from peagle_train.config import RegenConfig

from .template import build_prompt_ids

Message = dict[str, str]

#: HTTP statuses retried (with ``regen.max_retries``) besides connection errors.
RETRY_STATUS = {429, 500, 502, 503, 504}


@dataclass
class Completion:
    """One generated assistant turn.

    ``text``: the answer (stripped); ``reasoning``: the reasoning text if the engine
    separated it (else None); ``tokens``: generated tokens (the server's
    ``usage.completion_tokens``, or vLLM's output ids; includes the end-of-turn token when
    the engine counts it); ``finished``: stopped by end-of-turn, not by ``max_tokens``.
    """

    text: str
    reasoning: str | None
    tokens: int
    finished: bool


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

    def __call__(self, jobs: list[tuple[int, int, list[Message]]]) -> list[Completion]:
        """Complete ``(conversation index, turn, messages)`` jobs, ``concurrency`` at a time, in order."""
        with ThreadPoolExecutor(max_workers=self.cfg.concurrency) as pool:
            return list(pool.map(lambda j: self._one(*j), jobs))

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

    def __call__(self, jobs: list[tuple[int, int, list[Message]]]) -> list[Completion]:
        outs = self.llm.chat([m for _, _, m in jobs], self.params, use_tqdm=self.progress)
        res = []
        for o in outs:
            c = o.outputs[0]
            res.append(Completion(c.text.strip(), None, len(c.token_ids), c.finish_reason != "length"))
        return res

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- rounds


def _run_rounds(
    complete: Callable[[list[tuple[int, int, list[Message]]]], list[Completion]],
    tokenizer,
    conversations: list[list[Message]],
    max_prompt_tokens: int,
    progress: bool,
) -> tuple[list[list[Message]], dict, float]:
    """Regenerate turn by turn over all conversations (module docstring).

    Returns:
        ``(kept conversations, counts, generate seconds)``.
    """
    from tqdm.auto import tqdm

    from .regenerate import _split

    parts = [_split(c, k) for k, c in enumerate(conversations)]
    out: list[list[Message]] = [list(head) for head, _ in parts]
    alive = [True] * len(parts)
    counts = dict(prompts_too_long=0, empty_responses=0, unfinished_responses=0, turns_generated=0,
                  generated_tokens=0)
    seconds = 0.0
    total_turns = sum(len(users) for _, users in parts)
    bar = tqdm(total=total_turns, unit="turn", desc="regenerate (vllm)", disable=not progress)

    def history(k: int) -> list[Message]:  # role/content only: reasoning is not sent back
        return [{"role": m["role"], "content": m["content"]} for m in out[k]]

    def end(k: int, counter: str) -> None:
        counts[counter] += 1
        alive[k] = False
        bar.update(len(parts[k][1]) - (len(out[k]) - len(parts[k][0])) // 2)

    for r in range(max((len(u) for _, u in parts), default=0)):
        jobs = []
        for k, (_, users) in enumerate(parts):
            if alive[k] and r < len(users):
                msgs = history(k) + [{"role": "user", "content": users[r]}]
                if len(build_prompt_ids(tokenizer, msgs)) > max_prompt_tokens:
                    end(k, "prompts_too_long")
                else:
                    jobs.append((k, r, msgs))
        if not jobs:
            continue
        t0 = time.perf_counter()
        results = complete(jobs)
        seconds += time.perf_counter() - t0
        for (k, _, _), c in zip(jobs, results):
            counts["generated_tokens"] += c.tokens
            counts["unfinished_responses"] += not c.finished
            if not c.text:
                end(k, "empty_responses")
                continue
            turn = {"role": "assistant", "content": c.text}
            if c.reasoning:
                turn["reasoning"] = c.reasoning
            out[k] += [{"role": "user", "content": parts[k][1][r]}, turn]
            counts["turns_generated"] += 1
            bar.update(1)
        bar.set_postfix(tok_s=f"{counts['generated_tokens'] / max(seconds, 1e-9):.1f}")
    bar.close()
    n_turns = [(len(o) - len(h)) // 2 for o, (h, _) in zip(out, parts)]
    counts["conversations_cut"] = sum(0 < n < len(u) for n, (_, u) in zip(n_turns, parts))
    counts["turns_requested"] = total_turns
    return [o for o, n in zip(out, n_turns) if n > 0], counts, seconds


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
    from .regenerate import _split, regen_report

    for k, c in enumerate(conversations):  # fail on a bad row before contacting any engine
        _split(c, k)
    engine = _ServerEngine(cfg) if cfg.server_url else _OfflineEngine(cfg, model, progress)
    try:
        kept, counts, seconds = _run_rounds(engine, tokenizer, conversations, max_prompt_tokens, progress)
    finally:
        engine.close()
    tokens = counts.pop("generated_tokens")
    head = {"backend": "vllm", "engine": "server" if cfg.server_url else "offline", "server_url": cfg.server_url,
            "model": engine.model, "concurrency": cfg.concurrency if cfg.server_url else None}
    cut, requested = counts.pop("conversations_cut"), counts.pop("turns_requested")
    report = regen_report(cfg, head, n_in=len(conversations), n_out=len(kept), cut=cut, turns_requested=requested,
                          counts=counts, generated_tokens=tokens, seconds=seconds,
                          max_prompt_tokens=max_prompt_tokens, eos_ids=None)
    return kept, report
