"""The device timeline of a torch.profiler run, for bench/profile_decode.py's gaps mode: how busy the device was
over its span, the idle gaps between its kernels and copies (what ran before and after each), the engine phases
(`phase:<name>` record_function ranges) the host was in during them, and the CUDA runtime calls it made then."""

from __future__ import annotations

import bisect

import torch


def phase_marks(raw: list) -> list[tuple[float, float, str]]:  # type: ignore[type-arg]
    """The engine phases (record_function ranges) by start: a stack at any time lists them outermost first."""
    return sorted(
        (e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3, e.name()[6:])
        for e in raw
        if e.name().startswith("phase:") and e.device_type() == torch.autograd.DeviceType.CPU
    )


def phase_stack(marks: list[tuple[float, float, str]], at: float) -> str:
    """The phases the host was in at `at`, outermost first."""
    return " > ".join(n for a, b, n in marks if a <= at <= b) or "-"


Gap = tuple[float, float, str, str]  # an idle stretch of the device: start us, end us, what ran before and after


def runtime_calls_while_idle(raw: list, idle: list[Gap]) -> None:  # type: ignore[type-arg]
    """The CUDA runtime calls the host made (the profiler's CPU-side cuda* events: allocations, pinned memory,
    synchronisations, copies, launches) by name, with the part of their time that the device spent idle: a call
    that blocks the host while nothing is queued (a cudaMalloc or cudaHostAlloc waiting for the device to drain,
    say) shows here, where the phase table only says which engine function it was in."""
    starts = [g[0] for g in idle]
    by_name: dict[str, list[float]] = {}
    for e in raw:
        if e.device_type() != torch.autograd.DeviceType.CPU or not e.name().startswith("cuda"):
            continue
        s, t = e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3
        overlap, k = 0.0, bisect.bisect_right(starts, t) - 1
        while k >= 0 and idle[k][1] > s:
            overlap += max(0.0, min(t, idle[k][1]) - max(s, idle[k][0]))
            k -= 1
        row = by_name.setdefault(e.name(), [0, 0.0, 0.0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + e.duration_ns() / 1e3, row[2] + overlap
    print("CUDA runtime calls on the host: count, total ms, ms of it while the device idled, name")
    for name, (n, total, during) in sorted(by_name.items(), key=lambda kv: -kv[1][2])[:15]:
        print(f"  {int(n):6d} {total / 1e3:9.2f} {during / 1e3:9.2f}  {name}")


def busy_and_gaps(prof, tokens: int, batch: int, context: int) -> tuple[list, list[Gap]] | None:  # type: ignore[no-untyped-def,type-arg]  # noqa: E501
    """Print the profile's device busy time against its span, the idle gaps by the kernels around them, and
    (where the host was recorded) the phases it was in during them; the raw events and the idle gaps, or None
    if there were no device events."""
    raw = list(prof.profiler.kineto_results.events())
    events = sorted(
        (
            (e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3, e.name())
            for e in raw
            if e.device_type() == torch.autograd.DeviceType.CUDA and not e.name().startswith("phase:")
        ),
        key=lambda e: e[0],
    )
    marks = phase_marks(raw)
    if not events:
        print("the profiler recorded no device events")
        return None
    start, end = events[0][0], max(e[1] for e in events)
    busy, gap_by = 0.0, dict[str, list[float]]()
    cur_s, cur_e, last = events[0]
    idle: list[Gap] = []
    for s, t, name in events[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gap_by.setdefault(f"{last[:50]} -> {name[:50]}", []).append(s - cur_e)
            idle.append((cur_e, s, last, name))
            cur_s = s
        if t >= cur_e:
            cur_e, last = t, name
    busy += cur_e - cur_s
    wall = end - start
    print(f"{tokens} tokens ({batch} requests) at {context}, overlapped bursts: GPU span {wall / 1e3:.2f} ms "
          f"({wall / tokens:.1f} us a "
          f"token), busy {busy / 1e3:.2f} ms ({busy / tokens:.1f} us a token, {100 * busy / wall:.1f}%)")  # fmt: skip
    print("idle gaps by (before -> after): count, total us, max us")
    for key, g in sorted(gap_by.items(), key=lambda kv: -sum(kv[1]))[:20]:
        print(f"  {len(g):5d} {sum(g):9.1f} {max(g):8.1f}  {key}")
    print("what the host was in while the GPU idled (phase ranges overlapping idle time; nested ones overlap):")
    within: dict[str, float] = {}
    for a, b, name in marks:
        within[name] = within.get(name, 0.0) + sum(max(0.0, min(b, g1) - max(a, g0)) for g0, g1, _, _ in idle)
    total_idle = sum(g1 - g0 for g0, g1, _, _ in idle)
    for name, us in sorted(within.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {us / 1e3:8.2f} ms of {total_idle / 1e3:.2f} ms idle")

    print("the 12 longest idle gaps: us, GPU before -> after; host phases at 0, 1/3, 2/3 and the end of the gap")
    for g0, g1, before, after in sorted(idle, key=lambda g: g[0] - g[1])[:12]:
        at = [phase_stack(marks, g0 + f * (g1 - g0)) for f in (0.0, 1 / 3, 2 / 3, 1.0)] if marks else []
        print(f"  {g1 - g0:7.1f}  {before[:32]} -> {after[:32]}" + "".join(f"\n      {x}" for x in at))
    return raw, idle


# the host calls that put work on the device: kernels (torch's and Triton's launchers), copies, memsets, graphs
LAUNCH_CALLS = frozenset(
    ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync",
     "cudaMemsetAsync", "cudaGraphLaunch")
)  # fmt: skip


def launches_by_source(prof, top: int = 30) -> int:  # type: ignore[no-untyped-def]
    """Print the device work a profile with `with_stack=True` launched, by the innermost engine function
    (`services/` frame) above each launch call, with the torch ops that launched most of it; the total count.
    Answers which code issues a run's thousands of small launches (the gap table names only kernels)."""
    rows: dict[str, tuple[int, dict[str, int]]] = {}
    for e in prof.events():
        if e.name not in LAUNCH_CALLS:
            continue
        op, frame, parent = "", "(no services/ frame)", e.cpu_parent
        while parent is not None:
            if not op and parent.name.startswith("aten::"):
                op = parent.name
            if "services/" in parent.name:
                frame = parent.name
                break
            parent = parent.cpu_parent
        count, ops = rows.get(frame, (0, {}))
        ops[op or e.name] = ops.get(op or e.name, 0) + 1
        rows[frame] = (count + 1, ops)
    total = sum(n for n, _ in rows.values())
    print(f"device launches by the engine function above them ({total} in all): count, function, its commonest ops")
    for frame, (n, ops) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        common = ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:3])
        print(f"  {n:7d}  {frame}  ({common})")
    return total
