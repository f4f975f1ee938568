"""Host KV store throughput: put/get pages/s (single and batched, both data paths), restore GB/s
into a torch tensor, and the cold tier (ratio per dtype and restore speed) on real SmolLM2 KV.

    .venv/bin/python bench/store.py                   # CPU
    python bench/store.py --device cuda --repeat 5    # GPU: restore into GPU memory, first without a
                                                      # store (arena-shaped memory), then through one

Starts its own redis-server and kvstore processes (real gRPC, real shared-memory arena). Paths:
`shm` = same host (Reserve/Commit into the mapped arena; GetPages returns pinned views),
`grpc` = bytes in the messages (PutPages, GetPagesStream), as for a store on another host.

`--device cuda` first measures, in one run and without any store, host memory laid out like an
arena (4 KiB-aligned slots in a /dev/shm file) registered with cudaHostRegister, pages of SmolLM2
(1.47 MB) and Gemma 3 270M (1.18 MB) in batches of 8/32/128: one pinned H2D copy (the limit),
pageable H2D, the batched restore (kernels/pages/restore.py: `copies` and `triton`, pages consecutive in
the arena or scattered), and the engine's old path (a copy per page, stack, pageable H2D), each in
GB/s and as a ratio to the pinned copy. Then, when redis-server is here, KVStoreHostPages.fetch_to
end to end (GetPages + copies + Unpin) on both paths. Prints markdown tables (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from services.engine.kernels.pages.restore import (  # noqa: E402
    host_tensor,
    register_host,
    restore_pages,
    restore_reference,
    unregister_host,
)
from services.kvstore.arena import HEADER_BYTES, MAP_FLAGS, round_up  # noqa: E402

if TYPE_CHECKING:  # the store's client needs redis-py and grpc: imported where used
    from services.kvstore.client import KVStoreClient, PageMeta

SMOLLM2_BF16_PAGE = 30 * 2 * 64 * 3 * 64 * 2  # layers x K,V x tokens x kv heads x head dim x bytes
GEMMA3_BF16_PAGE = 18 * 2 * 64 * 256 * 2  # Gemma 3 270M full-attention layers: 18 x K,V x 64 x 1 x 256 x 2
CUDA = torch.device("cuda")
RESTORE_PAGES = (("SmolLM2 bf16", SMOLLM2_BF16_PAGE), ("Gemma 3 270M bf16", GEMMA3_BF16_PAGE))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def redis_server() -> Iterator[str]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not installed: run scripts/setup.sh")
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", d],
                                stdout=subprocess.DEVNULL)  # fmt: skip
        try:
            for _ in range(200):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                    break
                except OSError:
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait()


@contextmanager
def kvstore(redis_url: str, host_kv_mib: int, *extra: str) -> Iterator[str]:
    address = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "services.kvstore", "--listen-addr", address, "--host-kv-mib", str(host_kv_mib),
            "--redis-url", redis_url, "--replica-id", f"bench-{address.rsplit(':', 1)[1]}", *extra]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    said: deque[str] = deque(maxlen=12)  # its last lines before it was ready: the reason, when it never is
    try:
        for line in proc.stderr:
            if " ready on " in line:
                break
            said.append(line.rstrip())
        else:
            tail = "\n  ".join(said)
            sys.exit(f"kvstore did not start (rc {proc.wait()}); its last lines:\n  {tail}")
        yield address
    finally:
        proc.terminate()
        proc.wait()


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Best wall time of `repeat` runs (each run may need fresh inputs: fn handles that)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def new_pages(n: int, data: list[bytes], kv_format: str) -> list[tuple[PageMeta, bytes]]:
    from services.kvstore.client import PageMeta

    return [(PageMeta(os.urandom(16), kv_format, 64, len(data[i % len(data)])), data[i % len(data)]) for i in range(n)]


def batches(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def restore(client: KVStoreClient, hashes: list[bytes], dst: torch.Tensor, batch: int) -> None:
    """get_pages in batches, each page copied into its row of dst (a [pages, bytes] uint8 tensor)."""
    row = 0
    for chunk in batches(hashes, batch):
        with client.get_pages(chunk) as got:
            for page in got:
                assert page is not None
                dst[row].numpy()[:] = np.frombuffer(page, dtype=np.uint8)
                row += 1


def bench_paths(address: str, args: argparse.Namespace, rows: list[tuple[str, ...]]) -> dict[str, float]:
    """put/get pages/s and restore GB/s on both paths; returns GB/s figures by name."""
    from services.kvstore.client import KVStoreClient

    data = [np.random.default_rng(i).bytes(args.page_bytes) for i in range(4)]
    n, nbytes = args.pages, args.pages * args.page_bytes
    dst = torch.empty(n, args.page_bytes, dtype=torch.uint8)
    gbps: dict[str, float] = {}
    for path in ("shm", "grpc"):
        with KVStoreClient(address, shared_memory=path == "shm", timeout_s=120) as client:
            single = new_pages(n, data, "bf16")
            s_put1 = timed(lambda p=single: [client.put_page(m, d) for m, d in p], 1)  # pages are new once
            batched = new_pages(n, data, "bf16")
            s_putb = timed(lambda p=batched: [client.put_pages(b) for b in batches(p, args.batch)], 1)
            hashes = [m.page_hash for m, _ in batched]
            s_get1 = timed(lambda hs=hashes: [client.get_page(h) for h in hs], args.repeat)
            s_getb = timed(lambda hs=hashes: restore(client, hs, dst, args.batch), args.repeat)
            assert dst[n - 1].numpy().tobytes() == batched[n - 1][1]
            rows.append((path, "put_page", f"{n / s_put1:,.0f}", f"{nbytes / s_put1 / 1e9:.2f}"))
            rows.append((path, f"put_pages x{args.batch}", f"{n / s_putb:,.0f}", f"{nbytes / s_putb / 1e9:.2f}"))
            rows.append((path, "get_page", f"{n / s_get1:,.0f}", f"{nbytes / s_get1 / 1e9:.2f}"))
            rows.append(
                (path, f"get_pages x{args.batch} -> tensor", f"{n / s_getb:,.0f}", f"{nbytes / s_getb / 1e9:.2f}")
            )
            gbps[f"restore {path}"] = nbytes / s_getb / 1e9
            if args.device == "cuda":
                gbps |= bench_fetch_to(client, path, hashes, args)
    src = np.frombuffer(b"".join(data * (n // len(data) + 1))[:nbytes], dtype=np.uint8).reshape(n, -1)
    s_copy = timed(lambda: dst.numpy().__setitem__(slice(None), src), args.repeat)
    rows.append(("-", "memcpy host->tensor (limit)", f"{n / s_copy:,.0f}", f"{nbytes / s_copy / 1e9:.2f}"))
    return gbps


def arena_memory(num_pages: int, page_bytes: int) -> tuple[mmap.mmap, int, torch.Tensor, list[int]]:
    """A /dev/shm file laid out like a kvstore arena (header, then 4 KiB-aligned slots) filled with
    random bytes, mapped: (mapping, address, uint8 tensor over it, slot offsets)."""
    stride = round_up(page_bytes)
    nbytes = HEADER_BYTES + num_pages * stride
    with tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
        os.ftruncate(f.fileno(), nbytes)
        mm = mmap.mmap(f.fileno(), nbytes, flags=MAP_FLAGS)
    holder = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(holder)
    del holder
    arena = host_tensor(address, nbytes)
    chunk = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for lo in range(0, nbytes, chunk.numel()):
        arena[lo : lo + chunk.numel()] = chunk[: nbytes - lo]
    offsets = [HEADER_BYTES + i * stride for i in range(num_pages)]
    for i, off in enumerate(offsets):  # every page distinct
        arena[off : off + 8] = torch.tensor(list(i.to_bytes(8, "little")), dtype=torch.uint8)
    return mm, address, arena, offsets


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_timed(fn: Callable[[], object], repeat: int, device: torch.device = CUDA) -> float:
    """Best wall time of `repeat` runs of fn, each ended by a device synchronize (after one warm-up)."""
    fn()
    sync(device)

    def run() -> None:
        fn()
        sync(device)

    return timed(run, repeat)


def bench_restore_cuda(args: argparse.Namespace, device: torch.device = CUDA) -> list[tuple[str, ...]]:
    """Host -> GPU restores of batches of pages from registered arena-shaped memory (no store). On a
    CPU device (a dry run of the bench itself) nothing is registered and only `copies` runs."""
    cuda = device.type == "cuda"
    methods = ("copies", "triton") if cuda else ("copies",)
    rows: list[tuple[str, ...]] = []
    batches_ = [int(b) for b in args.restore_batches.split(",")]
    repeat = max(args.repeat, 5)
    for model, page in RESTORE_PAGES:
        num_slots = 2 * max(batches_)
        mm, address, arena, slots = arena_memory(num_slots, page)
        if cuda:
            register_host(address, arena.numel())
        try:
            assert arena.is_pinned() or not cuda, "the registered arena is not seen as pinned memory"
            rng = np.random.default_rng(1)
            for batch in batches_:
                nbytes = batch * page
                layouts = {
                    "consecutive": slots[:batch],
                    "scattered": [slots[i] for i in rng.permutation(num_slots)[:batch]],
                }
                gpu = torch.empty(batch, page, dtype=torch.uint8, device=device)
                pageable = restore_reference(arena, layouts["consecutive"], page, torch.device("cpu"))
                pinned = pageable.pin_memory() if cuda else pageable
                times = {
                    "pinned H2D, one copy (limit)": device_timed(
                        lambda g=gpu, s=pinned: g.copy_(s, non_blocking=True), repeat, device
                    ),
                    "pageable H2D, one copy": device_timed(lambda g=gpu, s=pageable: g.copy_(s), repeat, device),
                }
                for layout, offsets in layouts.items():
                    expected = restore_reference(arena, offsets, page, device)
                    for method in methods:

                        def restore(
                            o: list[int] = offsets, m: str = method, g: torch.Tensor = gpu, a: torch.Tensor = arena
                        ) -> None:
                            restore_pages(a, o, g, method=m)

                        try:
                            times[f"restore {method}, {layout}"] = device_timed(restore, repeat, device)
                        except Exception as e:  # report it and go on with the other methods
                            logging.error("restore %s failed: %s: %s", method, type(e).__name__, e)
                            continue
                        assert torch.equal(gpu, expected), f"{method} {layout}: bytes differ from the reference"
                    times[f"old path (copy per page, stack, pageable H2D), {layout}"] = device_timed(
                        lambda o=offsets, m=mm, n=page: old_path(m, o, n, device), repeat, device
                    )
                limit = nbytes / times["pinned H2D, one copy (limit)"] / 1e9
                for what, seconds in times.items():
                    gbps = nbytes / seconds / 1e9
                    rows.append((model, str(batch), what, f"{gbps:.2f}", f"{gbps / limit:.2f}"))
        finally:
            sync(device)
            if cuda:
                unregister_host(address)
            del arena
            mm.close()
    return rows


def old_path(mm: mmap.mmap, offsets: list[int], page: int, device: torch.device) -> torch.Tensor:
    """What the ring did before fetch_to: a CPU tensor per page (one copy each), stack, .to(cuda)."""
    view = memoryview(mm)
    pages = [torch.from_numpy(np.frombuffer(view[o : o + page], dtype=np.uint8).copy()) for o in offsets]
    return torch.stack(pages).to(device, non_blocking=True)


def bench_fetch_to(
    client: KVStoreClient, path: str, hashes: list[bytes], args: argparse.Namespace, device: torch.device = CUDA
) -> dict[str, float]:
    """KVStoreHostPages.fetch_to(cuda) end to end (GetPages, copies, Unpin) vs the old fetch + stack + H2D."""
    from services.engine.kv.write_through import WriteThrough
    from services.engine.ring.host_pages import KVStoreHostPages

    host = KVStoreHostPages(client, WriteThrough(client, "bf16", 8), args.page_bytes, restore_method="copies")
    out: dict[str, float] = {}
    for batch in (32, 128):
        chunk = hashes[:batch]
        nbytes = len(chunk) * args.page_bytes
        new = device_timed(lambda c=chunk: host.fetch_to(c, device), args.repeat, device)
        old = device_timed(
            lambda c=chunk: torch.stack(host.fetch(c)).to(device, non_blocking=True), args.repeat, device
        )
        out[f"{path}: fetch_to({device.type}) x{len(chunk)}"] = nbytes / new / 1e9
        out[f"{path}: old fetch + stack + H2D x{len(chunk)}"] = nbytes / old / 1e9
    return out


def real_kv_pages(num_tokens: int) -> torch.Tensor:
    """KV pages of the embedded SmolLM2 over a real text (fp32 on CPU): [pages, layers, 2, 64, H, D]."""
    from services.common.pagehash import chain_hashes
    from services.engine.builder import build_engine
    from services.engine.config import EngineConfig
    from services.engine.step.sampling import SamplingParams
    from services.engine.step.sequence import Done, Failed

    engine, info = build_engine(EngineConfig(device="cpu", kv_capacity=2048, max_context=2048, replica_id="bench"))
    try:
        text = "\n\n".join(p.read_text() for p in sorted((REPO_ROOT / "docs").glob("*.md")))
        ids = engine.tokenizer.encode(text)[:num_tokens]
        seq = engine.submit("kv", ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), namespace="b")
        while not isinstance(seq.events.get(timeout=600), Done | Failed):
            pass
        hashes = chain_hashes(seq.token_ids, info.page_size, info.model_id, info.kv_format, namespace="b")
        slots = [engine.slots.lookup(h) for h in hashes]
        return torch.stack([engine.pool.read_page(s).clone() for s in slots if s is not None])
    finally:
        engine.stop()


def rans_nbytes(raw: np.ndarray, width: int) -> int | None:
    """Order-0 rANS (constriction) per byte plane, with each plane's histogram; None if not installed."""
    try:
        import constriction
    except ImportError:
        return None
    total = 0
    for plane in raw.reshape(-1, width).T:
        counts = np.bincount(plane, minlength=256).astype(np.float64)
        coder = constriction.stream.stack.AnsCoder()
        coder.encode_reverse(
            plane.astype(np.int32), constriction.stream.model.Categorical(counts / counts.sum(), perfect=False)
        )
        total += coder.get_compressed().nbytes + 256 * 2
    return total


def bench_codec(kv: torch.Tensor, rows: list[tuple[str, ...]]) -> dict[str, bytes]:
    """Ratio and speed of the cold-tier codec per dtype; returns one dtype's pages for the store run."""
    import zstandard

    from services.kvstore.codec import PageCodec

    codec, out = PageCodec(), {}
    for name, dtype, width in (("fp32", torch.float32, 4), ("bf16", torch.bfloat16, 2), ("fp16", torch.float16, 2)):
        pages = [p.to(dtype).contiguous().view(torch.uint8).numpy().reshape(-1) for p in kv]
        raw = sum(p.nbytes for p in pages)
        blobs: list[bytes] = []
        s_comp = timed(lambda ps=pages, bs=blobs, f=name: bs.extend(codec.compress(memoryview(p), f) for p in ps), 1)
        out_page = memoryview(bytearray(pages[0].nbytes))
        s_dec = timed(lambda bs=blobs, o=out_page: [codec.decompress_into(memoryview(b), o) for b in bs], 3)
        plain = sum(len(zstandard.ZstdCompressor(level=1).compress(p.tobytes())) for p in pages)
        rans = [rans_nbytes(p, width) for p in pages]
        rans_ratio = f"{raw / sum(r for r in rans if r):.3f}" if all(rans) else "n/a"
        rows.append((name, f"{raw / plain:.3f}", f"{raw / sum(map(len, blobs)):.3f}", rans_ratio,
                     f"{raw / s_comp / 1e6:,.0f}", f"{raw / s_dec / 1e6:,.0f}"))  # fmt: skip
        out[name] = b"".join(p.tobytes() for p in pages)
    return out


def bench_cold_store(redis_url: str, kv_bytes: bytes, page_bytes: int, args: argparse.Namespace) -> tuple[float, float]:
    """Real bf16 KV through a store whose pages go cold after 0.5 s: (ratio in the store, restore GB/s)."""
    from services.kvstore.client import KVStoreClient

    data = [kv_bytes[i : i + page_bytes] for i in range(0, len(kv_bytes), page_bytes)]
    n = max(args.pages // 2, len(data))
    mib = max(64, 2 * n * page_bytes >> 20)
    with kvstore(redis_url, mib, "--cold-after-s", "0.5") as address, KVStoreClient(address, timeout_s=120) as client:
        pages = new_pages(n, data, "bf16")
        for b in batches(pages, args.batch):
            client.put_pages(b)
        deadline = time.monotonic() + 120
        while client.info().num_cold_pages < n and time.monotonic() < deadline:
            time.sleep(0.1)
        info = client.info()
        assert info.num_cold_pages == n, f"only {info.num_cold_pages} of {n} pages went cold"
        dst = torch.empty(n, page_bytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        restore(client, [m.page_hash for m, _ in pages], dst, args.batch)
        seconds = time.perf_counter() - t0
        assert dst[0].numpy().tobytes() == pages[0][1]
        return info.cold_raw_bytes / info.cold_bytes, n * page_bytes / seconds / 1e9


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=128)
    p.add_argument("--page-bytes", type=int, default=SMOLLM2_BF16_PAGE, help="default: one SmolLM2 bf16 page")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--restore-batches", default="8,32,128", help="cuda: pages per restore")
    p.add_argument("--restore-only", action="store_true", help="cuda: only the restore table (no store)")
    p.add_argument("--kv-tokens", type=int, default=1024, help="tokens of real SmolLM2 KV for the cold tier")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.device == "cuda":
        print("\nrestore into GPU memory from arena-shaped host memory registered with cudaHostRegister (no store)\n")
        print(table(("pages", "batch", "transfer", "GB/s", "x pinned"), bench_restore_cuda(args)))
        if args.restore_only:
            return
        if shutil.which("redis-server") is None:
            print("\nredis-server is not installed here: the store part (and fetch_to end to end) is skipped")
            return
    mib = (4 * args.pages * args.page_bytes >> 20) + 64
    rows: list[tuple[str, ...]] = []
    with redis_server() as redis_url:
        with kvstore(redis_url, mib, "--cold-after-s", "0") as address:
            gbps = bench_paths(address, args, rows)
        print(f"\npages of {args.page_bytes:,} bytes, {args.pages} per run, batches of {args.batch}\n")
        print(table(("path", "operation", "pages/s", "GB/s"), rows))
        if args.device == "cuda":
            print("\n" + table(("restore", "GB/s"), [(k, f"{v:.2f}") for k, v in gbps.items()]))
        try:
            kv = real_kv_pages(args.kv_tokens)
        except Exception as e:  # the embedded SmolLM2 package is not on every machine
            print(f"\ncold tier skipped: no SmolLM2 KV here ({type(e).__name__}: {e})")
            return
        codec_rows: list[tuple[str, ...]] = []
        kv_by_dtype = bench_codec(kv, codec_rows)
        print(f"\ncold tier on {kv.shape[0]} real SmolLM2 pages (zstd level 1; MB/s of raw bytes)\n")
        print(table(("dtype", "zstd ratio", "shuffle+zstd ratio", "shuffle+rANS ratio", "compress MB/s",
                     "restore MB/s"), codec_rows))  # fmt: skip
        page_bytes = kv[0].numel() * 2
        ratio, cold_gbps = bench_cold_store(redis_url, kv_by_dtype["bf16"], page_bytes, args)
        print(f"\nstore, bf16 KV gone cold: ratio in the store {ratio:.3f}, restore via get_pages {cold_gbps:.2f} GB/s")


if __name__ == "__main__":
    main()
