"""The segment planner's ladder (DESIGN.md §5): L1 direct, L2 shard, L2z rebuild, L3 refuse.

`decide` picks the level from token counts, before any model call:
- the prompt plus the answer's reserve fits the pool -> L1 (one call, as the client sent it);
- over the pool, by the request's over-pool policy: `refuse` -> L3; `sparse`/`exact` -> L1 with
  that prefill policy (the engine's ring; an engine without one answers 400); `shard` -> L2 when
  the request has a document and a question, else L3.
`run` carries out L2: split the document to fit the pool, map every shard (concurrently, at most
`map_concurrency` calls in flight), check each partial answer against its shard's text, and
reduce: aggregations exactly in code (aggregate.py); one checked answer, or several that agree,
as is; checked answers that disagree on values -> L3; free-text answers by a model reduce, which
re-shards its own input when that is over the pool (L2z). No checked answer, or the call budget
spent -> L3. No FastAPI and no gRPC here: the model is behind `Backend`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from services.gateway.planner import aggregate, refusals
from services.gateway.planner.backend import Backend, CallResult
from services.gateway.planner.evidence import Grounding, ground
from services.gateway.planner.plan import (
    Decision,
    Evidence,
    Level,
    Limits,
    PlannedAnswer,
    PlannerSettings,
    PlanReport,
    PlanRequest,
    Progress,
    Refusal,
    Usage,
)
from services.gateway.planner.prompts import (
    PartialLine,
    extract_prompt,
    map_prompt,
    parse_items,
    parse_partial,
    reduce_prompt,
)
from services.gateway.planner.refusals import Refused
from services.gateway.planner.splitter import Shard, detect_format, split
from services.gateway.planner.task import (
    Message,
    NotSplittable,
    Task,
    task_from_messages,
    task_from_text,
    upper_bound_tokens,
)

logger = logging.getLogger(__name__)

OnProgress = Callable[[Progress], Awaitable[None]]

SAFETY_TOKENS = 16  # per call, for tokens that do not add up exactly across a shard's units
MIN_SHARD_TOKENS = 64
MAX_CONTEXT_TOKENS = 64  # shard context (CSV header, heading path) at most
MAX_SPLIT_ATTEMPTS = 4
COUNT_CONCURRENCY = 8
MAX_PAIRED_QUOTE_CHARS = 200


class Planner:
    """Plans and runs one request; made per request (the backend is bound to it)."""

    def __init__(self, backend: Backend, settings: PlannerSettings, limits: Limits) -> None:
        self.backend = backend
        self.settings = settings
        self.limits = limits
        self._usage = Usage()
        self._replica = ""
        self._progress: OnProgress | None = None

    # ------------------------------------------------------------ the ladder

    async def decide(self, req: PlanRequest) -> Decision:
        """The level of this request (may call CountTokens; never the model)."""
        reserve = min(req.max_tokens or self.settings.answer_reserve, self.settings.answer_reserve)
        pool = self.limits.kv_capacity
        report = PlanReport(Level.L1, req.policy, pool, reserve, req.max_calls)
        if req.num_prompt_token_ids is not None:
            num_tokens = req.num_prompt_token_ids
        elif self._surely_fits(req, reserve):
            return Decision(Level.L1, report)
        else:
            num_tokens = await self.backend.count_prompt()
        report.prompt_tokens = num_tokens
        if num_tokens + reserve <= pool:
            return Decision(Level.L1, report)
        report.over_pool = True
        logger.info(
            "prompt of %d tokens + %d reserve over the %d-token pool: policy %s", num_tokens, reserve, pool, req.policy
        )
        if req.policy == "refuse":
            return self._refuse_now(report, Refusal.OVER_POOL, refusals.over_pool(num_tokens, reserve, pool))
        if req.policy in ("sparse", "exact"):
            return Decision(Level.L1, report, prefill_policy=req.policy)
        try:
            task = self._task(req)
        except NotSplittable as exc:
            return self._refuse_now(report, Refusal.NOT_SPLITTABLE, refusals.not_splittable(str(exc)))
        report.level = Level.L2
        return Decision(Level.L2, report, task=task)

    def _surely_fits(self, req: PlanRequest, reserve: int) -> bool:
        if req.messages is not None:
            bound = upper_bound_tokens(req.messages, req.extra_chars)
        else:
            bound = len((req.prompt_text or "").encode()) + 8
        return bound + reserve <= self.limits.kv_capacity

    @staticmethod
    def _task(req: PlanRequest) -> Task:
        if req.has_tools:
            raise NotSplittable("requests with tools are not split (a tool call needs the whole context)")
        if req.messages is not None:
            return task_from_messages(req.messages)
        if req.prompt_text is not None:
            return task_from_text(req.prompt_text)
        raise NotSplittable("a prompt given as token ids has no text to split at structural units")

    @staticmethod
    def _refuse_now(report: PlanReport, reason: Refusal, message: str) -> Decision:
        report.level, report.refusal, report.refusal_message = Level.L3, reason, message
        return Decision(Level.L3, report)

    async def run(self, decision: Decision, progress: OnProgress | None = None) -> PlannedAnswer:
        """Carry out an L2 decision (or answer an L3 one); returns the text and the report."""
        report = decision.report
        self._progress = progress
        if decision.level is Level.L3:
            return self._answer(refusals.refusal_text(report), report)
        assert decision.level is Level.L2 and decision.task is not None, decision.level
        try:
            text = await self._shard(decision.task, report)
        except Refused as exc:
            report.level, report.refusal, report.refusal_message = Level.L3, exc.reason, exc.message
            text = refusals.refusal_text(report)
        return self._answer(text, report)

    def _answer(self, text: str, report: PlanReport) -> PlannedAnswer:
        logger.info(
            "plan %s: %d shards, %d calls, map %s, reduce %s%s",
            report.level.value, report.num_shards, report.num_calls, report.map or "-", report.reduce or "-",
            f", refused: {report.refusal.value}" if report.refusal else "",
        )  # fmt: skip
        return PlannedAnswer(text, report, self._usage, self._replica)

    # ------------------------------------------------------------ L2

    async def _shard(self, task: Task, report: PlanReport) -> str:
        fmt = detect_format(task.document)
        query = None
        records: list[aggregate.Record] = []
        if aggregate.classify(task.ask) is not None:
            records = aggregate.records_of(task.document, fmt)
            query = aggregate.parse_query(task.ask, records)
        if query is not None and query.literal:
            mode, answer_tokens = "literal", 0
        elif query is not None:
            mode, answer_tokens = "extract", self.settings.extract_max_tokens
        else:
            mode, answer_tokens = "model", self.settings.map_max_tokens
        report.map = mode
        shards = await self._split(task, mode, answer_tokens, report)
        if mode == "literal":
            assert query is not None
            return self._literal(shards, records, query, report)
        if len(shards) > report.max_calls:
            raise Refused(
                Refusal.BUDGET_EXHAUSTED,
                refusals.budget_exhausted(len(shards), report.max_calls, f"answering in {len(shards)} parts"),
            )
        if mode == "extract":
            assert query is not None
            return await self._extract(task, shards, records, query, answer_tokens, report)
        groundings = await self._map(task, shards, answer_tokens, report)
        return await self._reduce(task, shards, groundings, report)

    async def _split(self, task: Task, mode: str, answer_tokens: int, report: PlanReport) -> list[Shard]:
        """Shards whose map call (frame + instructions + question + shard + answer) fits a call."""
        limit = self.limits.call_limit
        empty = self._map_messages(task, "", "", mode)
        base = await self.backend.count_chat(empty)
        context_tokens = min(MAX_CONTEXT_TOKENS, max(0, (limit - base) // 8))
        budget = limit - base - answer_tokens - SAFETY_TOKENS - context_tokens
        if budget < MIN_SHARD_TOKENS:
            raise Refused(Refusal.FRAME_TOO_LARGE, refusals.frame_too_large(base, limit, answer_tokens))
        doc_tokens = max(1, await self.backend.count_text(task.document))
        chars_per_token = max(len(task.document) / doc_tokens, 0.5)
        fmt = detect_format(task.document)

        def size(text: str) -> int:  # tokens, estimated from the document's own ratio
            return math.ceil(len(text) / chars_per_token)

        for _ in range(MAX_SPLIT_ATTEMPTS):
            shards = [
                self._with_context(s, chars_per_token, context_tokens) for s in split(task.document, budget, size, fmt)
            ]
            report.num_shards, report.shard_tokens = len(shards), budget
            if mode == "literal":
                return shards
            counts = await self._count_all([self._map_messages(task, s.text, s.context, mode) for s in shards])
            worst = max(counts)
            if worst + answer_tokens <= limit:
                logger.info("%d shards of at most %d tokens (call limit %d)", len(shards), worst, limit)
                return shards
            over = worst + answer_tokens - limit
            logger.info("a shard's call is %d tokens over the %d limit: splitting smaller", over, limit)
            budget = int((budget - over) * 0.95)
            if budget < MIN_SHARD_TOKENS:
                break
        raise Refused(Refusal.FRAME_TOO_LARGE, refusals.frame_too_large(base, limit, answer_tokens))

    @staticmethod
    def _with_context(shard: Shard, chars_per_token: float, context_tokens: int) -> Shard:
        max_chars = int(context_tokens * chars_per_token)
        context = shard.context if len(shard.context) <= max_chars else shard.context[-max_chars:]
        return dataclasses.replace(shard, context=context)

    @staticmethod
    def _map_messages(task: Task, shard_text: str, context: str, mode: str) -> list[Message]:
        build = extract_prompt if mode == "extract" else map_prompt
        return [*task.frame, Message("user", build(shard_text, context, task.question))]

    async def _count_all(self, chats: Sequence[Sequence[Message]]) -> list[int]:
        limit = asyncio.Semaphore(COUNT_CONCURRENCY)

        async def count(chat: Sequence[Message]) -> int:
            async with limit:
                return await self.backend.count_chat(chat)

        return await _gather(*(count(c) for c in chats))

    # ------------------------------------------------------------ map

    def _map_concurrency(self, num_shards: int, answer_tokens: int, report: PlanReport) -> int:
        per_call = report.shard_tokens + answer_tokens + SAFETY_TOKENS + MAX_CONTEXT_TOKENS
        fits = max(1, self.limits.kv_capacity // max(per_call, 1))
        return max(1, min(self.settings.map_concurrency, fits, num_shards))

    async def _map_calls(
        self, task: Task, shards: Sequence[Shard], mode: str, answer_tokens: int, report: PlanReport
    ) -> list[str]:
        """The raw answer of every shard's map call, in shard order."""
        limit = asyncio.Semaphore(self._map_concurrency(len(shards), answer_tokens, report))
        done = 0

        async def one(shard: Shard) -> str:
            nonlocal done
            async with limit:
                messages = self._map_messages(task, shard.text, shard.context, mode)
                result = await self._call(messages, answer_tokens, f"map{shard.index}", report)
            done += 1
            await self._report_progress(Progress("map", done, len(shards), report.num_calls))
            return result.text

        await self._report_progress(Progress("map", 0, len(shards), report.num_calls))
        return await _gather(*(one(s) for s in shards))

    async def _map(
        self, task: Task, shards: Sequence[Shard], answer_tokens: int, report: PlanReport
    ) -> list[Grounding]:
        texts = await self._map_calls(task, shards, "model", answer_tokens, report)
        groundings = []
        for shard, text in zip(shards, texts, strict=True):
            g = ground(parse_partial(text), shard.text, task.question)
            if not g.grounded and g.reason != "not found":
                report.num_dropped += 1
                logger.info("shard %d: answer dropped (%s): %r", shard.index, g.reason, text[:120])
            groundings.append(g)
        return groundings

    # ------------------------------------------------------------ reduce

    async def _reduce(
        self, task: Task, shards: Sequence[Shard], groundings: Sequence[Grounding], report: PlanReport
    ) -> str:
        found = [(k, g) for k, g in enumerate(groundings) if g.grounded]
        if not found:
            raise Refused(Refusal.NO_EVIDENCE, refusals.no_evidence(len(shards), report.num_dropped))
        if any(g.kind == "value" for _, g in found):  # values checked verbatim outrank free text
            found = [(k, g) for k, g in found if g.kind == "value"]
        groups: dict[str, list[tuple[int, Grounding]]] = {}
        for k, g in found:
            groups.setdefault(g.key, []).append((k, g))
        report.evidence = [Evidence(k, g.quote) for k, g in found]
        if len(groups) == 1:
            (members,) = groups.values()
            report.reduce = "single" if len(members) == 1 else "agreement"
            if members[0][1].kind == "text":
                report.flag("free_text")
            return members[0][1].answer
        if found[0][1].kind == "value":
            candidates = [(members[0][0], members[0][1].answer, members[0][1].quote) for members in groups.values()]
            raise Refused(Refusal.DISAGREEMENT, refusals.disagreement(candidates))
        report.flag("free_text")
        report.flag("model_reduce")
        lines = [PartialLine(f"part {k + 1}", g.answer, g.quote) for k, g in found]
        return await self._model_reduce(task, lines, report)

    async def _model_reduce(self, task: Task, lines: list[PartialLine], report: PlanReport) -> str:
        """Reduce partial answers with the model; while they do not fit one call, reduce groups of
        them first and reduce the results again (L2z)."""
        report.reduce = "model"
        limit = self.limits.call_limit
        answer_tokens = self.settings.reduce_max_tokens
        while True:
            report.num_rounds += 1
            await self._report_progress(Progress("reduce", 0, len(lines), report.num_calls))
            whole = self._reduce_messages(task, lines)
            if await self.backend.count_chat(whole) + answer_tokens <= limit:
                result = await self._call(whole, answer_tokens, f"reduce{report.num_rounds}", report)
                return " ".join(result.text.split())
            report.level = Level.L2Z
            groups = await self._reduce_groups(task, lines, limit - answer_tokens)
            needed = report.num_calls + len(groups) + 1
            if needed > report.max_calls:
                raise Refused(
                    Refusal.BUDGET_EXHAUSTED,
                    refusals.budget_exhausted(needed, report.max_calls, "reducing the partial answers"),
                )
            results = await _gather(
                *(
                    self._call(self._reduce_messages(task, g), answer_tokens, f"reduce{report.num_rounds}.{j}", report)
                    for j, g in enumerate(groups)
                )
            )
            lines = [PartialLine(f"summary {j + 1}", " ".join(r.text.split()), "") for j, r in enumerate(results)]

    @staticmethod
    def _reduce_messages(task: Task, lines: Sequence[PartialLine]) -> list[Message]:
        return [*task.frame, Message("user", reduce_prompt(lines, task.question))]

    async def _reduce_groups(self, task: Task, lines: list[PartialLine], max_prompt: int) -> list[list[PartialLine]]:
        """Consecutive groups of partial answers whose reduce prompt fits `max_prompt` tokens (at
        least two per group, so every round shrinks the input; a quote that does not fit is cut)."""
        groups: list[list[PartialLine]] = []
        current: list[PartialLine] = []
        for line in lines:
            if current and await self.backend.count_chat(self._reduce_messages(task, [*current, line])) > max_prompt:
                groups.append(current)
                current = []
            current.append(line)
        groups.append(current)
        if len(groups) >= len(lines):  # one answer per group makes no progress: pair them, quotes cut
            cut = [line._replace(quote=line.quote[:MAX_PAIRED_QUOTE_CHARS]) for line in lines]
            groups = [cut[k : k + 2] for k in range(0, len(cut), 2)]
        return groups

    # ------------------------------------------------------------ aggregations

    def _literal(
        self,
        shards: Sequence[Shard],
        records: Sequence[aggregate.Record],
        query: aggregate.AggQuery,
        report: PlanReport,
    ) -> str:
        matched: list[aggregate.Record] = []
        for shard in shards:  # the map of each shard, done in code
            matched += aggregate.literal_map(_in_shard(records, shard), query)
        return self._combine(query, matched, report)

    async def _extract(
        self,
        task: Task,
        shards: Sequence[Shard],
        records: Sequence[aggregate.Record],
        query: aggregate.AggQuery,
        answer_tokens: int,
        report: PlanReport,
    ) -> str:
        texts = await self._map_calls(task, shards, "extract", answer_tokens, report)
        matched: list[aggregate.Record] = []
        for shard, text in zip(shards, texts, strict=True):
            found, dropped = aggregate.match_items(parse_items(text), _in_shard(records, shard))
            matched += found
            report.num_dropped += dropped
        report.flag("extraction_recall")
        logger.info("extraction: %s (not literal: %s)", len(matched), query.reason)
        if not matched:
            raise Refused(Refusal.NO_EVIDENCE, refusals.no_evidence(len(shards), report.num_dropped))
        return self._combine(query, matched, report)

    @staticmethod
    def _combine(query: aggregate.AggQuery, matched: Sequence[aggregate.Record], report: PlanReport) -> str:
        try:
            result = aggregate.combine(query, matched)
        except aggregate.FieldMissing as exc:
            raise Refused(Refusal.FIELD_MISSING, str(exc)) from None
        report.reduce = query.kind.value
        report.aggregate = {
            "kind": query.kind.value,
            "criteria": aggregate.describe(query).removeprefix(" matching ") if query.literal else "",
            "field": query.field,
            "value": result.value,
            "num_records": result.num_records,
        }
        if not query.literal:
            report.aggregate["not_literal"] = query.reason
        return result.text

    # ------------------------------------------------------------ calls

    async def _call(self, messages: Sequence[Message], max_tokens: int, call_id: str, report: PlanReport) -> CallResult:
        if report.num_calls >= report.max_calls:
            raise Refused(
                Refusal.BUDGET_EXHAUSTED,
                refusals.budget_exhausted(report.num_calls + 1, report.max_calls, "this answer"),
            )
        report.num_calls += 1
        result = await self.backend.complete(messages, max_tokens, call_id)
        u = self._usage
        self._usage = Usage(
            u.prompt_tokens + result.prompt_tokens,
            u.completion_tokens + result.completion_tokens,
            u.cached_tokens + result.cached_tokens,
        )
        self._replica = result.engine_replica
        report.note_policy(result.prefill_policy, result.unverified)
        return result

    async def _report_progress(self, progress: Progress) -> None:
        if self._progress is not None:
            await self._progress(progress)


def _in_shard(records: Sequence[aggregate.Record], shard: Shard) -> list[aggregate.Record]:
    """The records that start inside the shard (a record is never split: it is a unit)."""
    return [r for r in records if shard.start <= r.start < shard.end]


async def _gather(*aws: Awaitable[Any]) -> list[Any]:
    """asyncio.gather that cancels the others when one fails (or the caller is cancelled)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
