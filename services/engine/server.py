"""The Engine gRPC servicer: decode the request, call the core, encode its events."""

from __future__ import annotations

import logging
import queue
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc

from services.common import auth, health
from services.common.limits import GRPC_CHANNEL_OPTIONS, cut_details
from services.common.protos import engine_pb2 as pb
from services.common.protos import engine_pb2_grpc as pb_grpc
from services.common.tokenizer import Tokenizer
from services.engine.builder import ModelInfo
from services.engine.engine import Engine
from services.engine.records import ContextLengthError, EngineStoppedError, OverloadedError
from services.engine.step.grammar import GrammarSpec
from services.engine.step.sampling import InvalidRequestError, Sampled, SamplingParams
from services.engine.step.sequence import Chunk, Done, Event, Failed, FinishReason

logger = logging.getLogger(__name__)

_FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
_POLICY = {pb.PREFILL_POLICY_EXACT: "exact", pb.PREFILL_POLICY_SPARSE: "sparse"}
_ERROR_CODES = {
    "invalid_argument": pb.ERROR_CODE_INVALID_ARGUMENT,
    "overloaded": pb.ERROR_CODE_OVERLOADED,
    "unavailable": pb.ERROR_CODE_UNAVAILABLE,
    "internal": pb.ERROR_CODE_INTERNAL,
}


def params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens or None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        logit_bias=dict(p.logit_bias),
        ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
        grammar=_grammar(p.grammar) if p.HasField("grammar") else None,
    )


def _grammar(g: pb.Grammar) -> GrammarSpec:
    return GrammarSpec(g.kind, g.text, g.prefix, g.suffix, g.separator, max(1, g.max_repeats))


TokenBytes = Callable[[int], bytes]


def _token_piece(tokenizer: Tokenizer | None, token_bytes: TokenBytes | None, token: int) -> tuple[str, bytes]:
    """A token's text and its own bytes (from the vocabulary: a piece of a multi-byte character is its bytes, where
    its decoded text is a replacement character); without a vocabulary table, the text's UTF-8."""
    if tokenizer is None:
        return "", b""
    text = tokenizer.decode([token])
    return text, token_bytes(token) if token_bytes is not None else text.encode("utf-8")


def logprob_to_proto(s: Sampled, tokenizer: Tokenizer | None, token_bytes: TokenBytes | None = None) -> pb.TokenLogprob:
    """A chosen token's log-probability and its alternatives, each with its text and bytes."""
    text, raw = _token_piece(tokenizer, token_bytes, s.token)
    top = []
    for token, logprob in s.top:
        t, b = _token_piece(tokenizer, token_bytes, token)
        top.append(pb.TopLogprob(token_id=token, token=t, token_bytes=b, logprob=logprob))
    return pb.TokenLogprob(token_id=s.token, token=text, token_bytes=raw, logprob=s.logprob or 0.0, top=top)


def event_to_proto(
    ev: Event, tokenizer: Tokenizer | None = None, token_bytes: TokenBytes | None = None
) -> pb.GenerateEvent:
    if isinstance(ev, Chunk):
        logprobs = [logprob_to_proto(s, tokenizer, token_bytes) for s in ev.logprobs]
        return pb.GenerateEvent(chunk=pb.TokenChunk(token_ids=ev.token_ids, text=ev.text, logprobs=logprobs))
    if isinstance(ev, Done):
        usage = pb.Usage(
            prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens, cached_tokens=ev.cached_tokens
        )
        done = pb.GenerateDone(
            finish_reason=_FINISH[ev.finish_reason],
            usage=usage,
            matched_stop=ev.matched_stop,
            prefill_policy=ev.prefill_policy,
            unverified=ev.unverified,
        )
        return pb.GenerateEvent(done=done)
    assert isinstance(ev, Failed)
    return pb.GenerateEvent(
        error=pb.GenerateError(code=_ERROR_CODES.get(ev.code, pb.ERROR_CODE_INTERNAL), message=ev.message)
    )


def _status_of(exc: Exception) -> grpc.StatusCode:
    """The one mapping of the engine's typed errors to gRPC status codes."""
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, ContextLengthError):
        return grpc.StatusCode.OUT_OF_RANGE
    if isinstance(exc, OverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, EngineStoppedError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class EngineServicer(pb_grpc.EngineServicer):
    def __init__(self, engine: Engine, info: ModelInfo) -> None:
        self.engine = engine
        self.info = info

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateEvent]:
        try:
            seq = self.engine.submit(
                request.request_id or uuid.uuid4().hex,
                list(request.prompt_token_ids),
                params_from_proto(request.sampling),
                request.namespace,
                prefill_policy=_POLICY.get(request.prefill_policy, ""),
                query_start=request.query_start if request.HasField("query_start") else None,
                question=_question(request),
                question_alone=request.question_alone,
            )
        except (InvalidRequestError, ContextLengthError, OverloadedError, EngineStoppedError) as exc:
            context.abort(_status_of(exc), cut_details(str(exc)))
        context.add_callback(lambda: self.engine.abort(seq))
        while True:
            try:
                ev = seq.events.get(timeout=0.5)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            yield event_to_proto(ev, self.engine.tokenizer, self.engine.token_bytes)
            if not isinstance(ev, Chunk):
                return

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.GetModelInfoResponse:
        i = self.info
        return pb.GetModelInfoResponse(
            model_id=i.model_id,
            architecture=i.architecture,
            max_context=i.max_context,
            kv_capacity=i.kv_capacity,
            page_size=i.page_size,
            kv_format=i.kv_format,
            vocab_size=i.vocab_size,
            eos_token_ids=list(i.eos_token_ids),
            device=i.device,
            dtype=i.dtype,
            replica_id=i.replica_id,
        )

    def GetStats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.GetStatsResponse:
        e = self.engine
        counts = e.slots.counts()
        wt = e.write_through
        s = e.stats
        local = e.pool.local
        return pb.GetStatsResponse(
            num_slots=counts.total,
            free_slots=counts.free,
            cached_slots=counts.cached,
            running_sequences=len(e.scheduler.running),
            waiting_sequences=len(e.scheduler.waiting),
            prompt_tokens_total=s.prompt_tokens_total,
            generated_tokens_total=s.generated_tokens_total,
            cached_tokens_total=s.cached_tokens_total,
            requests_total=s.requests_total,
            pages_written_through=wt.num_written if wt else 0,
            write_through_failures=(wt.num_failed + wt.num_dropped) if wt else 0,
            protect_pages=e.ring_snapshot.protect,
            skeleton_pages=e.ring_snapshot.skeleton,
            evidence_pages=e.ring_snapshot.evidence,
            recent_pages=e.ring_snapshot.recent,
            ring_free_pages=e.ring_snapshot.free,
            host_only_pages=e.ring_snapshot.host_only,
            restores_total=e.ring.num_restores if e.ring else 0,
            restored_bytes_total=e.ring.restored_bytes if e.ring else 0,
            prefetched_pages_total=e.ring.num_prefetched if e.ring else 0,
            demotions_total=e.ring.num_demotions if e.ring else 0,
            preemptions_total=e.scheduler.num_preemptions,
            local_rings=local.num_rings if local else 0,
            local_rings_free=local.num_free() if local else 0,
            local_rings_parked=local.num_parked if local else 0,
            local_ring_reuses_total=e.scheduler.prefixes.num_local_reuses,
            local_ring_fills_total=e.scheduler.prefixes.num_local_fills,
            device_kv_bytes=e.pool.nbytes + e.pool.local_nbytes,
            overlapped_steps_total=s.overlapped_steps_total,
        )


def serve(engine: Engine, info: ModelInfo, listen_addr: str, max_workers: int = 64, secret: str = "") -> grpc.Server:
    """Start the gRPC server (returns once it listens); with a secret, every call but health checks needs it."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="engine-rpc"),
        options=GRPC_CHANNEL_OPTIONS,
        interceptors=auth.server_interceptors(secret),
    )
    pb_grpc.add_EngineServicer_to_server(EngineServicer(engine, info), server)
    health.add_health(server)
    if server.add_insecure_port(listen_addr) == 0:
        raise OSError(f"cannot listen on {listen_addr}")
    server.start()
    return server


def _question(request: pb.GenerateRequest) -> tuple[int, int] | None:
    """The request's question span (the ring's question replay), when it gives both ends."""
    if request.HasField("question_start") and request.HasField("question_end"):
        return request.question_start, request.question_end
    return None
