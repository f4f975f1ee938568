"""EngineConfig: the one frozen configuration of the engine, read from flags and environment once."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field

import torch

from services.common import auth
from services.common.model_files import DEFAULT_MODEL
from services.engine.kernels.pages.restore import METHODS as RESTORE_METHODS
from services.engine.kv.kv_formats import KVFormatError, KVSpec, parse_spec
from services.engine.kv.paged_attention import PREFILL_MODES
from services.engine.ring.summaries import HEAD_FUSIONS


class ConfigError(ValueError):
    """An impossible configuration; the message carries the numbers."""


_KV_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUERY_PASSES = ("bound", "attention", "exact")  # EngineConfig.ring_query_pass
BURST_ON_CUDA = 8  # bench/RESULTS.md run 9: 8 vs 16 vs 1 step per round trip on the H200


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine process needs; derived values are properties."""

    listen_addr: str = "127.0.0.1:50052"
    model: str = DEFAULT_MODEL
    model_id: str = ""  # served name; empty: derived from the model file
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    dtype: str = "auto"  # compute dtype: auto (fp32 on cpu, bf16 on cuda), fp32, bf16, fp16
    kv_format: str = "auto"  # KV page format per layer (kv_formats.py): e.g. auto, bf16, fp8, nvfp4+h, fp8,global=bf16
    page_size: int = 64
    max_context: int = 8192  # logical context of one sequence (tokens)
    kv_capacity: int = 8192  # device pool (tokens); rounded up to whole pages
    prefill_chunk: int = 512  # prompt tokens per forward step
    max_running: int = 16  # sequences decoded together
    max_waiting: int = 256  # queued requests before RESOURCE_EXHAUSTED
    kvstore_addrs: tuple[str, ...] = ()  # write-through targets; empty: no host copy
    redis_url: str = ""  # with it, pages go to every kvstore replica registered there (consistent hashing)
    catalog_prefix: str = "kvmem:"  # the kvstores' catalog keys in that redis (theirs: --catalog-prefix)
    internal_secret: str = field(default="", repr=False)  # required on calls in, sent to the kvstores (auth.py)
    write_through_queue: int = 256  # pages waiting to be written before new ones are dropped
    replica_id: str = ""
    num_threads: int = 0  # torch CPU threads; 0: torch's default
    host_kv_mib: int = 1024  # the kvstore's budget, for the start-up capacity guard
    # how host pages reach the device (kernels/pages/restore.py): "copies" (a cudaMemcpyAsync per run of consecutive
    # pages) or "triton" (one gather launch a batch reading the registered arena in place; a held exact chunk's layer
    # is one launch instead of a copy per page)
    restore_method: str = "copies"
    # a held read's (the exact chunk's host pages, a layer's bytes of each at a time) on CUDA: one gather launch instead
    # of a copy a page (ring/host_pages.KVStoreHostPages); off CUDA held reads copy
    held_restore_method: str = "triton"
    # how prompt chunks attend (kv/paged_attention.resolve_prefill_mode): "auto" (FlashAttention-4 on a GPU it runs
    # on with flash-attn-4 installed, else cuDNN's fused attention on CUDA; the masked SDPA path elsewhere), "fa4",
    # "cudnn", "triton", "flash", "masked"
    prefill_attention: str = "auto"
    # -- the ring (active for a sequence whose pages outgrow ring_budget) --
    prefill_policy: str = "sparse"  # default for over-budget prompts: sparse or exact
    ring_budget: int = 0  # resident tokens one sequence may hold; 0: the whole pool
    protect_tokens: int = 128  # attention sinks + head of the prompt, always resident
    recent_tokens: int = 0  # trailing window; 0: one ring chunk + one page
    skeleton_tokens: int = 256  # query span (last user turn) kept resident
    retrieval_share: float = 1.0  # evidence budget = share x (budget - protect - recent); bench/RESULTS.md
    neighbor_pages: int = 0  # seam completion reach (1 until 2026-12-02: three picks + their neighbours ranked worse)
    query_tail: int = 64  # scored tokens when no query span is known
    rescore_interval: int = 16  # decode steps between re-selections (0: select at prefill only)
    # decode re-selections take effect this many steps later, their host pages fetched meanwhile. Two bursts of 8:
    # the fetch starts when the scoring burst's tokens are read, with the next burst already on the device, and
    # takes ~3 ms on the H200 host (GetPages, Python, the copy) against ~3.4 ms a burst of 8 at 32K, so one
    # burst left the device idle ~1.7 ms a re-selection; two leave it ~0.2 ms (bench/RESULTS.md, run 20)
    ring_prefetch_steps: int = 16
    # a decode re-selection scores and takes effect inside a decode burst, on the device (scheduler._burst), instead
    # of ending the burst at each sequence's re-selection step: the same steps read the same pages either way. Both
    # read sets are resident for that burst, so it needs free slots beyond the sequences' budgets (the bench rows
    # give a quarter of the budget); without them the burst ends before the switch, as with this off
    ring_switch_in_burst: bool = True
    retrieval: bool = True  # False: the negative control (evidence stays empty)
    # selection (ring/state.py RingLimits): each head votes its top k pages (0: mass summed over heads), a decode
    # re-selection keeps the prompt's best anchor pages, recent pages are no candidates (bench/longeval)
    ring_vote_top: int = 0
    ring_anchor_pages: int = 4
    # read-ahead (RingLimits.read_ahead): the prompt's selection also takes the pages after its best page, a decode
    # re-selection the pages after each page it picks from the decode step's scores: an answer that reads the context
    # in order (a copy, a list) moves on into the next page before the next re-selection is in effect
    # (rescore_interval + prefetch steps later); bench/longeval's `recite` task. R lead pages take R evidence picks.
    # 2 with copy following since 2026-12-06 (tuning: 60 of 201 sentences copied vs 55 with 1, dense 61; held-out:
    # 71% vs dense 60%, keyed tasks unchanged: bench/RESULTS.md, "The long copy, round 2")
    ring_read_ahead: int = 2
    # copy following (RingLimits.follow_copy): a decode re-selection finds the answer's last this-many tokens in the
    # prompt and leads with the pages the copy reads until the next re-selection is in effect (0: off; 4 since
    # 2026-12-06: without it the ring copied 6% of a long passage's sentences, dense 60%)
    ring_follow_copy: int = 4
    # question replay (RingLimits.question_replay): a request's question span (the cache guard sends a long chat
    # message's first paragraph unless the message asks last) is read again after the document, in a scoring pass
    # that keeps nothing, and its attention ranks the prompt's pages with the query span's
    ring_question_replay: bool = True
    ring_exclude_recent: bool = False
    # how the last prompt chunk's query picks the prompt's evidence (RingLimits.query_pass): "bound" (a scoring
    # pass over the page summaries' Quest bound), "attention" (the scoring pass attends every page, host ones
    # streamed, and pages are ranked by its real attention mass), "exact" (no scoring pass: the last chunk itself
    # attends every page and its real attention ranks them). The defaults since 2026-12-02 (exact, the upper half
    # of the layers, no seam neighbours, 4 anchors; longeval's `v3`) answered like dense on the held-out split
    # through the stack where the Quest bound (`v0`) lost two thirds (bench/RESULTS.md, "Long-context evaluation")
    ring_query_pass: str = "exact"
    ring_score_from: float = 0.5  # layers below this fraction of the model's depth score no pages
    ring_head_fusion: str = "sum"  # how their masses rank pages (summaries.fuse_heads: sum, norm, rrf:K, max, peak)
    audit_dir: str = ""  # write per-selection scores and choices here
    local_ring: bool = True  # sliding-window layers in a small ring per sequence, not in the slots (local_ring.py)
    # recurrent (linear-attention) layers: their state is snapshotted every this many pages for prefix reuse
    state_interval_pages: int = 8
    state_snapshots: int = 32  # snapshots kept on the device (LRU; older ones come back from the kvstore)
    # -- GPU execution --
    cuda_graphs: bool = True  # capture decode steps in CUDA graphs (CUDA only)
    decode_burst: int = 0  # greedy decode steps per host round trip (1: off; 0: auto, BURST_ON_CUDA on CUDA, 1 on CPU)
    decode_overlap: bool = True  # launch the next greedy burst before reading the last one's tokens (engine.py)
    split_bursts: bool = False  # split steps around host-sampled requests (scheduler.py); off: unproven on the GPU
    kernels: str = "auto"  # page kernel set: auto (from the device capability), triton, cupy, torch

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a power of two, got {self.page_size}")
        if self.kv_capacity < self.page_size:
            raise ConfigError(f"kv_capacity {self.kv_capacity} is smaller than one page ({self.page_size})")
        if self.max_context <= 0:
            raise ConfigError(f"max_context must be positive, got {self.max_context}")
        if not 0 <= self.decode_burst <= self.page_size:
            raise ConfigError(f"decode_burst must be in [0, page_size {self.page_size}], got {self.decode_burst}")
        if self.ring_query_pass not in QUERY_PASSES:
            raise ConfigError(f"ring_query_pass must be one of {QUERY_PASSES}, got {self.ring_query_pass!r}")
        if self.ring_head_fusion.partition(":")[0] not in HEAD_FUSIONS:
            raise ConfigError(f"ring_head_fusion must be one of {HEAD_FUSIONS}, got {self.ring_head_fusion!r}")
        if not 0.0 <= self.ring_score_from < 1.0:
            raise ConfigError(f"ring_score_from must be in [0, 1), got {self.ring_score_from}")
        for name in ("restore_method", "held_restore_method"):
            if getattr(self, name) not in RESTORE_METHODS:
                raise ConfigError(f"{name} must be one of {RESTORE_METHODS}, got {getattr(self, name)!r}")
        if self.prefill_attention not in PREFILL_MODES:
            raise ConfigError(f"prefill_attention must be one of {PREFILL_MODES}, got {self.prefill_attention!r}")
        if not self.catalog_prefix:
            raise ConfigError("catalog_prefix must not be empty")
        if self.ring_prefetch_steps < 0:
            raise ConfigError(f"ring_prefetch_steps must be >= 0, got {self.ring_prefetch_steps}")
        if self.ring_budget_pages > self.num_slots:
            raise ConfigError(f"ring_budget {self.ring_budget} tokens > kv_capacity {self.pool_tokens}")
        min_working = self.protect_pages + self.recent_pages + 1
        if min_working > self.ring_budget_pages:
            raise ConfigError(
                f"protect {self.protect_pages} + recent {self.recent_pages} + 1 working page = {min_working} pages "
                f"> ring budget {self.ring_budget_pages} pages: short by {min_working - self.ring_budget_pages} page(s)"
            )
        chunk_pages = self.ring_chunk // self.page_size + 1  # a chunk's pages, with the one it starts in
        if self.ring_enabled and self.recent_pages < chunk_pages:
            raise ConfigError(
                f"recent_tokens {self.recent_tokens} = {self.recent_pages} pages cannot hold a prefill chunk of "
                f"{self.ring_chunk} tokens ({chunk_pages} pages with the page it starts in): set recent_tokens "
                f">= {(chunk_pages - 1) * self.page_size + 1} or 0 (the default: one chunk and a page)"
            )
        if self.prefill_policy not in ("sparse", "exact"):
            raise ConfigError(f"prefill_policy {self.prefill_policy!r} not in sparse, exact")
        if not 0.0 <= self.retrieval_share <= 1.0:
            raise ConfigError(f"retrieval_share must be in [0, 1], got {self.retrieval_share}")
        if self.state_interval_pages < 1 or self.state_snapshots < 1:
            raise ConfigError("state_interval_pages and state_snapshots must be >= 1")
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.max_running < 1 or self.max_waiting < 1:
            raise ConfigError(f"max_running {self.max_running} and max_waiting {self.max_waiting} must be >= 1")
        if self.dtype not in ("auto", *_KV_FORMATS):
            raise ConfigError(f"dtype {self.dtype!r} not in auto, {', '.join(_KV_FORMATS)}")
        if self.kernels not in ("auto", "triton", "cupy", "torch"):
            raise ConfigError(f"kernels {self.kernels!r} not in auto, triton, cupy, torch")
        self.kv_spec  # noqa: B018 -- parses and validates the spec (ConfigError naming the bad part)

    def burst_for(self, device: torch.device) -> int:
        """The decode burst on this device: the setting, or auto (0): BURST_ON_CUDA steps on CUDA, where a
        step's host work is as long as the step itself; one on the CPU, where the step's compute dwarfs the
        host work and a burst would only make the stream come in lumps."""
        if self.decode_burst:
            return self.decode_burst
        return BURST_ON_CUDA if device.type == "cuda" else 1

    @property
    def num_slots(self) -> int:
        """Device pool size in pages."""
        return -(-self.kv_capacity // self.page_size)

    @property
    def pool_tokens(self) -> int:
        return self.num_slots * self.page_size

    @property
    def has_host_store(self) -> bool:
        return bool(self.kvstore_addrs or self.redis_url)

    @property
    def ring_enabled(self) -> bool:
        """The ring is active only when one sequence's context can outgrow its resident budget."""
        return self.max_context > self.ring_budget_pages * self.page_size

    def check_host_capacity(self, page_nbytes: int) -> None:
        """Refuse a ring whose host store cannot hold what the pool cannot (called once the page size is known)."""
        host_pages = self.host_kv_mib * 2**20 // page_nbytes if self.has_host_store else 0
        logical_pages = -(-self.max_context // self.page_size)
        if self.ring_enabled and host_pages + self.num_slots < logical_pages:
            where = "kvstore configured" if self.has_host_store else "no kvstore configured"
            raise ConfigError(
                f"host_pages + pool_pages < ceil(max_context / page_size): {host_pages} + {self.num_slots} "
                f"< {logical_pages} (max_context {self.max_context}, host_kv_mib {self.host_kv_mib}, {where})"
            )

    @property
    def ring_budget_pages(self) -> int:
        return -(-self.ring_budget // self.page_size) if self.ring_budget else self.num_slots

    @property
    def protect_pages(self) -> int:
        return -(-self.protect_tokens // self.page_size)

    @property
    def ring_chunk(self) -> int:
        """Prefill chunk of a ring sequence: at most a quarter of its budget."""
        return max(self.page_size, min(self.prefill_chunk, self.ring_budget_pages // 4 * self.page_size))

    @property
    def recent_pages(self) -> int:
        if self.recent_tokens:
            return -(-self.recent_tokens // self.page_size)
        return self.ring_chunk // self.page_size + 1

    @property
    def skeleton_pages(self) -> int:
        return -(-self.skeleton_tokens // self.page_size)

    @property
    def evidence_pages(self) -> int:
        room = self.ring_budget_pages - self.protect_pages - self.recent_pages
        return max(0, int(room * self.retrieval_share))

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.torch_device.type == "cpu" else torch.bfloat16
        return _KV_FORMATS[self.dtype]

    @property
    def kv_spec(self) -> KVSpec:
        """The parsed per-layer KV format spec (`auto` = the compute dtype); resolved per layer by the builder."""
        auto = {v: k for k, v in _KV_FORMATS.items()}[self.torch_dtype]
        try:
            return parse_spec(self.kv_format, auto)
        except KVFormatError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def kv_dtype(self) -> torch.dtype:
        """The plain dtype of a uniform plain spec; otherwise the compute dtype (what gathers return)."""
        uniform = self.kv_spec.uniform
        return uniform.dtype if uniform is not None and uniform.plain else self.torch_dtype

    @property
    def kv_format_name(self) -> str:
        """The canonical spec (model info)."""
        return self.kv_spec.name

    @property
    def kv_page_label(self) -> str:
        """The page format label (page hashes, write-through): the spec and its layout versions."""
        return self.kv_spec.page_label

    @property
    def replica_name(self) -> str:
        return self.replica_id or f"engine-{socket.gethostname()}-{self.listen_addr.rsplit(':', 1)[-1]}"

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> EngineConfig:
        """Flags override environment variables (KVMEM_*), which override the defaults."""
        env = os.environ.get
        d = cls.__dataclass_fields__
        p = argparse.ArgumentParser(prog="python -m services.engine", description="KVMem engine")
        p.add_argument("--listen", default=env("KVMEM_ENGINE_ADDR", d["listen_addr"].default))
        p.add_argument("--model", default=env("KVMEM_MODEL", DEFAULT_MODEL))
        p.add_argument("--model-id", default=env("KVMEM_MODEL_ID", ""))
        p.add_argument("--device", default=env("KVMEM_DEVICE", "auto"))
        p.add_argument("--dtype", default=env("KVMEM_DTYPE", "auto"))
        p.add_argument("--kv-format", default=env("KVMEM_KV_FORMAT", "auto"))
        p.add_argument("--page-size", type=int, default=int(env("KVMEM_PAGE_SIZE", "64")))
        p.add_argument("--max-context", type=int, default=int(env("KVMEM_MAX_CONTEXT", "8192")))
        p.add_argument("--kv-capacity", type=int, default=int(env("KVMEM_KV_CAPACITY", "8192")))
        p.add_argument("--prefill-chunk", type=int, default=int(env("KVMEM_PREFILL_CHUNK", "512")))
        p.add_argument("--max-running", type=int, default=int(env("KVMEM_MAX_RUNNING", "16")))
        p.add_argument("--max-waiting", type=int, default=int(env("KVMEM_MAX_WAITING", "256")))
        p.add_argument(
            "--kvstore",
            default=env("KVMEM_KVSTORE_ADDRS", ""),
            help="comma-separated kvstore addresses for page write-through",
        )
        p.add_argument(
            "--redis-url",
            default=env("KVMEM_REDIS_URL", ""),
            help="catalog of kvstore replicas; pages are placed across all of them",
        )
        p.add_argument(
            "--catalog-prefix",
            default=env("KVMEM_CATALOG_PREFIX", d["catalog_prefix"].default),
            help="key prefix of the kvstore catalog in --redis-url (the kvstores' and cache guard's --catalog-prefix)",
        )
        p.add_argument("--replica-id", default=env("KVMEM_ENGINE_REPLICA_ID", ""))
        p.add_argument("--num-threads", type=int, default=int(env("KVMEM_NUM_THREADS", "0")))
        p.add_argument("--host-kv-mib", type=int, default=int(env("KVMEM_HOST_KV_MIB", "1024")))
        p.add_argument("--restore-method", choices=RESTORE_METHODS, default=env("KVMEM_RESTORE_METHOD", "copies"))
        p.add_argument(
            "--held-restore-method", choices=RESTORE_METHODS, default=env("KVMEM_HELD_RESTORE_METHOD", "triton")
        )
        p.add_argument(
            "--prefill-attention",
            choices=PREFILL_MODES,
            default=env("KVMEM_PREFILL_ATTENTION", "auto"),
            help="how prompt chunks attend on CUDA: auto = fa4 (FlashAttention-4) where it runs, else cudnn",
        )
        p.add_argument("--prefill-policy", default=env("KVMEM_PREFILL_POLICY", "sparse"))
        p.add_argument("--ring-budget", type=int, default=int(env("KVMEM_RING_BUDGET", "0")))
        p.add_argument("--protect-tokens", type=int, default=int(env("KVMEM_PROTECT_TOKENS", "128")))
        p.add_argument("--recent-tokens", type=int, default=int(env("KVMEM_RECENT_TOKENS", "0")))
        p.add_argument("--skeleton-tokens", type=int, default=int(env("KVMEM_SKELETON_TOKENS", "256")))
        p.add_argument("--retrieval-share", type=float, default=float(env("KVMEM_RETRIEVAL_SHARE", "1.0")))
        p.add_argument("--neighbor-pages", type=int, default=int(env("KVMEM_NEIGHBOR_PAGES", str(cls.neighbor_pages))))
        p.add_argument("--rescore-interval", type=int, default=int(env("KVMEM_RESCORE_INTERVAL", "16")))
        p.add_argument(
            "--ring-prefetch-steps",
            type=int,
            default=int(env("KVMEM_RING_PREFETCH_STEPS", "16")),
            help="decode steps between a re-selection and its evidence taking effect (its host pages are "
            "fetched in the background meanwhile); 0: at the next step, restored inside it",
        )
        p.add_argument(
            "--no-ring-switch-in-burst",
            action="store_true",
            default=env("KVMEM_RING_SWITCH_IN_BURST", "1") == "0",
            help="end a decode burst at each sequence's re-selection step, as before (A/B runs)",
        )
        p.add_argument(
            "--no-retrieval",
            action="store_true",
            default=env("KVMEM_RETRIEVAL", "1") == "0",
            help="negative control: the ring keeps no evidence pages",
        )
        p.add_argument("--ring-vote-top", type=int, default=int(env("KVMEM_RING_VOTE_TOP", str(cls.ring_vote_top))))
        p.add_argument(
            "--ring-anchor-pages", type=int, default=int(env("KVMEM_RING_ANCHOR_PAGES", str(cls.ring_anchor_pages)))
        )
        p.add_argument(
            "--ring-read-ahead", type=int, default=int(env("KVMEM_RING_READ_AHEAD", str(cls.ring_read_ahead)))
        )
        p.add_argument(
            "--ring-follow-copy", type=int, default=int(env("KVMEM_RING_FOLLOW_COPY", str(cls.ring_follow_copy)))
        )
        p.add_argument(
            "--ring-question-replay",
            type=int,
            default=int(env("KVMEM_RING_QUESTION_REPLAY", str(int(cls.ring_question_replay)))),
        )
        p.add_argument(
            "--ring-exclude-recent",
            type=int,
            default=int(env("KVMEM_RING_EXCLUDE_RECENT", str(int(cls.ring_exclude_recent)))),
        )
        p.add_argument(
            "--ring-query-pass", default=env("KVMEM_RING_QUERY_PASS", cls.ring_query_pass), choices=QUERY_PASSES
        )
        p.add_argument(
            "--ring-score-from", type=float, default=float(env("KVMEM_RING_SCORE_FROM", str(cls.ring_score_from)))
        )
        p.add_argument("--ring-head-fusion", default=env("KVMEM_RING_HEAD_FUSION", cls.ring_head_fusion))
        p.add_argument("--audit-dir", default=env("KVMEM_RING_AUDIT_DIR", ""))
        p.add_argument(
            "--no-cuda-graphs",
            action="store_true",
            default=env("KVMEM_CUDA_GRAPHS", "1") == "0",
            help="run decode steps eagerly (no CUDA graph capture)",
        )
        p.add_argument(
            "--decode-burst",
            type=int,
            default=int(env("KVMEM_DECODE_BURST", "0")),
            help="greedy decode steps run on the device per host round trip (1: one step at a time; 0: auto, "
            f"{BURST_ON_CUDA} on CUDA, 1 on the CPU)",
        )
        p.add_argument(
            "--split-bursts",
            action="store_true",
            default=env("KVMEM_SPLIT_BURSTS", "0") == "1",
            help="let greedy requests burst beside host-sampled ones (split steps, scheduler.py; off by default: on "
            "the CPU it slowed the host-sampled request 4-5x for no measured gain, the GPU is not measured)",
        )
        p.add_argument(
            "--no-decode-overlap",
            action="store_true",
            default=env("KVMEM_DECODE_OVERLAP", "1") == "0",
            help="read each greedy burst's tokens before launching the next (no overlapped bursts)",
        )
        p.add_argument("--kernels", default=env("KVMEM_KERNELS", "auto"), help="auto, triton, cupy or torch")
        p.add_argument(
            "--no-local-ring",
            action="store_true",
            default=env("KVMEM_LOCAL_RING", "1") == "0",
            help="keep sliding-window layers in the page slots too (every layer paged)",
        )
        p.add_argument(
            "--state-interval-pages",
            type=int,
            default=int(env("KVMEM_STATE_INTERVAL_PAGES", "8")),
            help="recurrent layers (qwen3_5): snapshot their state every this many pages (prefix reuse)",
        )
        a = p.parse_args(argv)
        return cls(
            listen_addr=a.listen,
            model=a.model,
            model_id=a.model_id,
            device=a.device,
            dtype=a.dtype,
            kv_format=a.kv_format,
            page_size=a.page_size,
            max_context=a.max_context,
            kv_capacity=a.kv_capacity,
            prefill_chunk=a.prefill_chunk,
            max_running=a.max_running,
            max_waiting=a.max_waiting,
            kvstore_addrs=tuple(x.strip() for x in a.kvstore.split(",") if x.strip()),
            replica_id=a.replica_id,
            redis_url=a.redis_url,
            catalog_prefix=a.catalog_prefix,
            internal_secret=auth.secret_from_env(),
            num_threads=a.num_threads,
            host_kv_mib=a.host_kv_mib,
            restore_method=a.restore_method,
            held_restore_method=a.held_restore_method,
            prefill_attention=a.prefill_attention,
            prefill_policy=a.prefill_policy,
            ring_budget=a.ring_budget,
            protect_tokens=a.protect_tokens,
            recent_tokens=a.recent_tokens,
            skeleton_tokens=a.skeleton_tokens,
            retrieval_share=a.retrieval_share,
            neighbor_pages=a.neighbor_pages,
            rescore_interval=a.rescore_interval,
            ring_prefetch_steps=a.ring_prefetch_steps,
            ring_switch_in_burst=not a.no_ring_switch_in_burst,
            retrieval=not a.no_retrieval,
            ring_vote_top=a.ring_vote_top,
            ring_anchor_pages=a.ring_anchor_pages,
            ring_read_ahead=a.ring_read_ahead,
            ring_follow_copy=a.ring_follow_copy,
            ring_question_replay=bool(a.ring_question_replay),
            ring_exclude_recent=bool(a.ring_exclude_recent),
            ring_query_pass=a.ring_query_pass,
            ring_head_fusion=a.ring_head_fusion,
            ring_score_from=a.ring_score_from,
            audit_dir=a.audit_dir,
            cuda_graphs=not a.no_cuda_graphs,
            decode_overlap=not a.no_decode_overlap,
            split_bursts=a.split_bursts,
            decode_burst=a.decode_burst,
            kernels=a.kernels,
            local_ring=not a.no_local_ring,
            state_interval_pages=a.state_interval_pages,
        )
