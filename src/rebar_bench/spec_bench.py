"""`rebar bench spec`: speculative decoding against rebar without it and llama-server's n-gram
speculation, on the same GGUF and threads, greedy, at most `tokens` new tokens (each answer ends
where the model ends it, unless `ignore_eos`: past its end a small model loops, which flatters
every n-gram drafter).

Every server configuration of a model runs at once, idle but for the one request in flight, and
each request goes to every configuration in turn before the next request (the order rotated each
round), so the host's drift falls on all of them alike, request by request; figures are medians
over the rounds:

- rebar with speculative decoding on (its other settings the defaults), and with
  `speculative = false`; the response cache off, so every request is decoded;
- llama-server `-np 1` without speculation, and with each `--spec-type` given (its n-gram types,
  their own default settings), for 1 stream; the best n-gram type is the peer.

Every server must render each request into the same prompt tokens (checked before the first
round): llama-server gets rebar's template format for a GGUF file without one
(`rebar_bench.llamacpp.chat_template_args`); otherwise it would fall back to ChatML, and answer
another question.

Each server answers every grounded request (rewrite a function with a variable renamed, extract
the sentences that mention something, summarise a passage) and a free-form chat question, one
stream at a time: output tokens per second from the first streamed token to the last. rebar's
servers also answer `batch` free-form chats at once: aggregate output tokens per second, in
`batch_pairs` back-to-back pairs a round (one batch with speculation, one without, the order
alternating); that row's ratio is the median of the pairs' own ratios, as a batch takes several
seconds and the host's speed drifts within them. The details give the draft tokens the batches
checked: where there were none, both servers did the same work and the row is the host's noise. A
random-weight model (`big_model`) runs the free-form chats (its drafts rarely hold), and with a
`draft_model` the same big model is drafted by a second model: tokens must equal rebar's without
speculation (greedy), and the acceptance is what it is.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx

from rebar_bench.compare import CompareReport, Row, compared
from rebar_bench.llamacpp import LlamaServer, PeerUnavailable, find_tool, rendered_chat
from rebar_bench.rebar_server import free_port, rebar_server_process
from rebar_bench.spec_prompts import CHAT, GROUNDED, SpecRequest

SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")
REBAR = "rebar"
REBAR_PLAIN = "rebar, no speculation"
SPECULATING = {"REBAR_ENGINE__SPECULATIVE": "true"}
NOT_SPECULATING = {"REBAR_ENGINE__SPECULATIVE": "false"}
PEER_PLAIN = "llama-server, no speculation"


@dataclass(frozen=True)
class SpecBenchConfig:
    models: tuple[str, ...] = ("smollm2", "gemma3")
    threads: int = 2
    tokens: int = 256
    ignore_eos: bool = False
    rounds: int = 2
    batch: int = 16
    batch_pairs: int = 2  # batches of `batch` chats with and without speculation, per round
    spec_types: tuple[str, ...] = SPEC_TYPES
    big_model: str | None = None  # a random-weight GGUF (rebar bench make-model --shape 1b)
    draft_model: str | None = None  # drafts for big_model (rebar bench make-model --shape 135m)
    llama_server: str | None = None  # its path; None: found as rebar_bench.llamacpp finds it
    grounded_target: float = 1.5  # rebar / rebar without speculation, grounded requests
    peer_target: float = 1.3  # rebar / llama-server's best n-gram type, grounded requests
    no_loss_target: float = 0.97  # rebar / rebar without speculation, where drafts rarely hold


@dataclass(frozen=True)
class Answer:
    """One streamed answer: tokens, text, output tokens/s from its first token to its last, and
    the draft tokens checked and kept (as the server reports them; None when it does not)."""

    tokens: int
    text: str
    tokens_per_s: float
    drafted: int | None = None
    accepted: int | None = None


def stream_chat(
    url: str, model: str, message: str, tokens: int, nonce: str, ignore_eos: bool = False
) -> Answer:
    """A streamed greedy chat completion of at most `tokens` tokens; `nonce` (an HTTP header,
    never in the prompt) only tells requests apart in the server's log."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": message}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text: list[str] = []
    first = last = None
    usage: dict = {}
    drafted = accepted = None
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, timeout=600, headers={"x-bench": nonce}
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            delta = "".join(
                (choice.get("delta") or {}).get("content") or "" for choice in chunk["choices"]
            )
            if delta:
                last = time.perf_counter()
                first = first or last
                text.append(delta)
            usage = chunk.get("usage") or usage
            timing = chunk.get("timing") or {}  # rebar's, in the usage chunk
            if "draft_tokens" in timing:
                drafted, accepted = timing["draft_tokens"], timing["accepted_draft_tokens"]
            if "timings" in chunk:  # llama-server's, in the last chunk; draft_n only if it drafted
                timings = chunk["timings"]
                drafted, accepted = timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
    count = int(usage.get("completion_tokens", 0))
    rate = (count - 1) / (last - first) if first and last and last > first else 0.0
    return Answer(count, "".join(text), rate, drafted, accepted)


@dataclass(frozen=True)
class Batch:
    """Chats answered at once: aggregate output tokens/s, and the draft tokens the server checked
    and kept over them (None when it does not report them)."""

    tokens_per_s: float
    drafted: int | None = None
    accepted: int | None = None


def many_chats(url: str, model: str, count: int, tokens: int, ignore_eos: bool) -> Batch:
    """`count` free-form chats at once; aggregate output tokens/s over the whole batch."""
    started = time.perf_counter()

    def one(i: int) -> Answer:
        return stream_chat(url, model, CHAT[i % len(CHAT)].message, tokens, f"b{i}", ignore_eos)

    with ThreadPoolExecutor(count) as pool:
        answers = list(pool.map(one, range(count)))
    rate = sum(a.tokens for a in answers) / (time.perf_counter() - started)
    if any(a.drafted is None or a.accepted is None for a in answers):
        return Batch(rate)
    return Batch(rate, sum(a.drafted or 0 for a in answers), sum(a.accepted or 0 for a in answers))


@dataclass
class ServerFigures:
    """What one server configuration did over the rounds, by request kind."""

    answers: dict[str, list[Answer]] = field(default_factory=dict)
    batches: list[Batch] = field(default_factory=list)  # in order, paired by index

    @property
    def batch_tokens_per_s(self) -> list[float]:
        return [batch.tokens_per_s for batch in self.batches]

    def batch_acceptance(self) -> tuple[int, int] | None:
        """Draft tokens checked and kept over every batch; None where not reported."""
        if not self.batches or any(b.drafted is None for b in self.batches):
            return None
        return sum(b.drafted or 0 for b in self.batches), sum(b.accepted or 0 for b in self.batches)

    def rate(self, kind: str) -> float | None:
        runs = self.answers.get(kind)
        return statistics.median(a.tokens_per_s for a in runs) if runs else None

    def acceptance(self, kinds: Sequence[str]) -> tuple[int, int] | None:
        drafted = accepted = 0
        for kind in kinds:
            for answer in self.answers.get(kind, []):
                if answer.drafted is None or answer.accepted is None:
                    return None
                drafted, accepted = drafted + answer.drafted, accepted + answer.accepted
        return drafted, accepted


@contextmanager
def rebar_at(model: str, threads: int, env: dict[str, str]) -> Iterator[str]:
    settings = {"REBAR_CACHE__ENABLED": "false", **env}
    with rebar_server_process(model, threads, env=settings) as (url, _process):
        yield url


@contextmanager
def llama_server_at(tool: Path, gguf: Path, threads: int, args: Sequence[str]) -> Iterator[str]:
    with LlamaServer(tool, gguf, threads, free_port(), 1, extra_args=args) as server:
        yield server.url


def served_name(url: str) -> str:
    """The name the server at `url` serves its (first) model under: rebar names a model file by
    its stem, so the path the bench was given is not a name it answers to."""
    listing = httpx.get(url + "/v1/models", timeout=60)
    listing.raise_for_status()
    return str(listing.json()["data"][0]["id"])


def warm_up(url: str) -> str:
    """The name `url` serves its model under, after a first short request (first-request costs
    stay out of the figures)."""
    model = served_name(url)
    stream_chat(url, model, "Say hello.", 8, "warm-up")
    return model


def rendered_prompt(url: str, model: str, message: str, llama_server: bool) -> tuple[int, ...]:
    """The tokens the server at `url` turns a one-message chat into, through its own chat template
    (rebar's `/tokenize` takes the messages; llama-server's: `rendered_chat`). rebar's ids are bare:
    for a model whose BOS rebar adds outside its template, the check stops at the first token
    rather than passing wrongly."""
    messages = [{"role": "user", "content": message}]
    if llama_server:
        return tuple(rendered_chat(url, messages)[1])
    body = {"model": model, "messages": messages}
    response = httpx.post(url + "/tokenize", json=body, timeout=60)
    response.raise_for_status()
    return tuple(response.json()["tokens"])


def check_same_prompts(
    served: dict[str, tuple[str, str]], peers: Collection[str], requests: Sequence[SpecRequest]
) -> None:
    """Raises unless every server (name -> its url and served name; `peers` name the llama-servers)
    turns each request into the same tokens: a server rendering another prompt answers another
    question, and its speed says nothing about the same request's."""
    for request in requests:
        rendered = {
            name: rendered_prompt(url, model, request.message, name in peers)
            for name, (url, model) in served.items()
        }
        if len(set(rendered.values())) > 1:
            counts = ", ".join(f"{name} {len(tokens)}" for name, tokens in rendered.items())
            raise RuntimeError(
                f"the servers render the {request.kind} request into different prompts (tokens: "
                f"{counts}); the figures would compare answers to different questions"
            )


def rotated(names: Sequence[str], by: int) -> list[str]:
    """`names` starting at position `by` (mod its length): each round leads with another server."""
    by %= max(len(names), 1)
    return [*names[by:], *names[:by]]


def interleave(
    servers: dict[str, tuple[str, str]],
    requests: Sequence[SpecRequest],
    config: SpecBenchConfig,
    figures: dict[str, ServerFigures],
    round_index: int,
) -> None:
    """One round: each request answered by every server (name -> its url and the name it serves
    its model under) in turn, one at a time."""
    for index, request in enumerate(requests):
        for name in rotated(list(servers), round_index + index):
            url, model = servers[name]
            answer = stream_chat(
                url,
                model,
                request.message,
                config.tokens,
                f"{request.kind}-{index}",
                config.ignore_eos,
            )
            figures.setdefault(name, ServerFigures()).answers.setdefault(request.kind, []).append(
                answer
            )


def measure_model(config: SpecBenchConfig, model: str, notes: list[str]) -> dict:
    """Figures of every server configuration on `model`, by configuration name."""
    from rebar.model.resolve import resolve_model_path

    requests = [*GROUNDED, CHAT[0]]
    figures: dict[str, ServerFigures] = {}
    peers: dict[str, list[str]] = {PEER_PLAIN: []}
    peers |= {f"llama-server {kind}": ["--spec-type", kind] for kind in config.spec_types}
    gguf = resolve_model_path(model)
    try:
        tool = find_tool("llama-server", config.llama_server)
    except PeerUnavailable as exc:
        notes.append(f"no llama-server figures: {exc}")
        peers = {}
    with ExitStack() as stack:
        servers = {
            REBAR: stack.enter_context(rebar_at(model, config.threads, SPECULATING)),
            REBAR_PLAIN: stack.enter_context(rebar_at(model, config.threads, NOT_SPECULATING)),
        }
        for name, args in peers.items():
            servers[name] = stack.enter_context(llama_server_at(tool, gguf, config.threads, args))
        served = {name: (url, warm_up(url)) for name, url in servers.items()}
        check_same_prompts(served, peers, [*GROUNDED, *CHAT])
        for round_index in range(config.rounds):
            interleave(served, requests, config, figures, round_index)
            batch_pairs(served, config, figures, round_index)
    return figures


def batch_pairs(
    servers: dict[str, tuple[str, str]],
    config: SpecBenchConfig,
    figures: dict[str, ServerFigures],
    round_index: int,
) -> None:
    """One round's `config.batch_pairs` pairs of `config.batch` chats, rebar with speculation and
    without back to back, the one going first alternating pair by pair and round by round."""
    for pair in range(config.batch_pairs):
        for name in rotated([REBAR, REBAR_PLAIN], round_index + pair):
            url, served_as = servers[name]
            figures.setdefault(name, ServerFigures()).batches.append(
                many_chats(url, served_as, config.batch, config.tokens, config.ignore_eos)
            )


def paired(figure: str, ours: list[float], theirs: list[float], target: float) -> Row:
    """A row of two series measured in pairs: medians side by side, and the median of the pairs'
    ratios (each pair close in time, so the host's drift cancels within it) against `target`."""
    ratios = [a / b for a, b in zip(ours, theirs) if b > 0]
    if not ratios:
        return compared(figure, None, None, target, True)
    ratio = statistics.median(ratios)
    row = compared(figure, statistics.median(ours), statistics.median(theirs), target, True)
    return replace(row, ratio=ratio, passed=ratio >= target)


def model_rows(config: SpecBenchConfig, model: str, figures: dict[str, ServerFigures]) -> list[Row]:
    ours, plain = figures[REBAR], figures[REBAR_PLAIN]
    peer_types = [n for n in figures if n.startswith("llama-server ") and n != PEER_PLAIN]
    rows = []
    for request in GROUNDED:
        kind = request.kind
        rows.append(
            compared(
                f"{model} {kind}: tok/s vs no speculation",
                ours.rate(kind),
                plain.rate(kind),
                config.grounded_target,
                True,
            )
        )
        best = max((figures[name].rate(kind) or 0.0 for name in peer_types), default=None)
        rows.append(
            compared(
                f"{model} {kind}: tok/s vs best llama n-gram",
                ours.rate(kind),
                best or None,
                config.peer_target,
                True,
            )
        )
    rows.append(
        compared(
            f"{model} chat, 1 stream: vs no speculation",
            ours.rate("chat"),
            plain.rate("chat"),
            config.no_loss_target,
            True,
        )
    )
    rows.append(
        paired(
            f"{model} chat, {config.batch} streams: vs no spec",
            ours.batch_tokens_per_s,
            plain.batch_tokens_per_s,
            config.no_loss_target,
        )
    )
    return rows


def detail_lines(model: str, figures: dict[str, ServerFigures]) -> list[str]:
    """Every configuration's tokens/s by request kind, and its acceptance where reported."""
    kinds = [r.kind for r in GROUNDED] + ["chat"]
    lines = ["", f"{model}: output tok/s, 1 stream (median of rounds); kept / drafted"]
    lines.append(f"{'server':<32}" + "".join(f"{k:>11}" for k in kinds) + "   acceptance")
    for name, figure in figures.items():
        rates = "".join(
            f"{figure.rate(k):>11.1f}" if figure.rate(k) else f"{'-':>11}" for k in kinds
        )
        counts = figure.acceptance(kinds)
        share = (
            f"   {counts[1]}/{counts[0]} ({counts[1] / counts[0]:.0%})"
            if counts and counts[0]
            else "   -"
        )
        lines.append(f"{name:<32}{rates}{share}")
    batched = figures.get(REBAR, ServerFigures()).batch_acceptance()
    if batched is not None:
        # Nothing drafted: both servers did the same work, and the batch row is the host's noise.
        lines.append(f"{REBAR}, batches of streams: kept / drafted {batched[1]}/{batched[0]}")
    return lines


def measure_big_model(
    config: SpecBenchConfig, notes: list[str]
) -> tuple[list[Row], list[str], dict[str, ServerFigures]]:
    """The random-weight model: free-form chat with and without speculation (and a draft model)."""
    assert config.big_model is not None
    model = config.big_model
    runs: dict[str, ServerFigures] = {}
    configurations = [(REBAR, SPECULATING), (REBAR_PLAIN, NOT_SPECULATING)]
    if config.draft_model:
        drafting = {**SPECULATING, "REBAR_ENGINE__DRAFT_MODEL": config.draft_model}
        configurations.append(("rebar, draft model", drafting))
    with ExitStack() as stack:
        servers = {
            name: stack.enter_context(rebar_at(model, config.threads, env))
            for name, env in configurations
        }
        served = {name: (url, warm_up(url)) for name, url in servers.items()}
        for round_index in range(config.rounds):
            interleave(served, CHAT, config, runs, round_index)
    label = Path(model).name
    rows = [
        compared(
            f"{label} chat: vs no speculation",
            runs[REBAR].rate("chat"),
            runs[REBAR_PLAIN].rate("chat"),
            config.no_loss_target,
            True,
        )
    ]
    lines = detail_lines(label, runs)
    if config.draft_model:
        drafted = runs["rebar, draft model"]
        same = [a.text for a in drafted.answers["chat"]] == [
            a.text for a in runs[REBAR_PLAIN].answers["chat"]
        ]
        rows.append(Row(f"{label} drafted: same text as without", None, None, None, "equal", same))
        rows.append(
            compared(
                f"{label} drafted: tok/s vs no speculation",
                drafted.rate("chat"),
                runs[REBAR_PLAIN].rate("chat"),
                config.no_loss_target,
                True,
            )
        )
        notes.append(f"draft model: {config.draft_model} drafting {model}")
    return rows, lines, runs


@dataclass
class SpecBenchReport:
    config: SpecBenchConfig
    rows: list[Row]
    notes: list[str]
    details: list[str]
    # Every answer of every round: model -> configuration -> figures.
    figures: dict[str, dict[str, ServerFigures]] = field(default_factory=dict)

    def table(self) -> str:
        models = ", ".join(self.config.models)
        head = CompareReport(models, self.config.threads, self.rows, self.notes)
        return "\n".join([head.table(), *self.details])

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def run_spec_bench(config: SpecBenchConfig) -> SpecBenchReport:
    notes = [
        f"greedy, at most {config.tokens} tokens"
        + (" (EOS ignored)" if config.ignore_eos else "")
        + f", {config.threads} threads, "
        f"{config.rounds} rounds; peers: llama-server -np 1 --spec-type "
        + " | ".join(config.spec_types)
    ]
    report = SpecBenchReport(config, [], notes, [])
    for model in config.models:
        figures = measure_model(config, model, notes)
        report.rows += model_rows(config, model, figures)
        report.details += detail_lines(model, figures)
        report.figures[model] = figures
    if config.big_model:
        big_rows, big_lines, big_figures = measure_big_model(config, notes)
        report.rows += big_rows
        report.details += big_lines
        report.figures[config.big_model] = big_figures
    return report
