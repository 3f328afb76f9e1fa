#!/usr/bin/env python3
"""shmwheel side by side with the timers users pick today, in one run on this machine.

``python bench/compare/run.py`` from the repository root runs, in this order:

1. The micro-benchmark (``bench/micro.py``): add, cancel, reset, the add+cancel
   pair, add_many and cancel_many, poll per fire, and the pair with 1 k to
   10 M timers pending (no 10 M level with ``--quick``).
2. A tight loop of add+cancel pairs through each backend's adapter, from
   this process: what one pair costs, nothing around it.
3. The request-timeout workload of ``stress.py`` with 1, 2 and 4 producer
   processes against shmwheel (one driver), a Redis sorted set on a
   ``redis-server`` started here on loopback, a ``multiprocessing.Manager``
   heap and a Unix-socket heap server (each with a poller process), and with
   one producer against ``asyncio`` and ``heapq`` in-process, which cannot
   cross processes and so are lower bounds.  Requests/s a producer and in
   all, fire lateness p50 / p99 / p99.9, lost and duplicated fires, the CPU
   time of the consumer and of the server, and the memory that holds the
   timers.  ``stress.py``'s docstring says exactly what is done and counted.

4. Rounds for the ratios the targets are about: the bare add+cancel loops
   of shmwheel and asyncio side by side (each round the other goes first),
   then the request loop with shmwheel with 1 producer, with 2, asyncio with
   1, and ``heapq`` with 1 and with 2 producers, each with a heap of its
   own, back to back, ``ROUNDS`` times; each target is the median of its
   ratio over the rounds.  The targets name add+cancel pairs, so the bare
   loops judge them; the request loop's ratios are given beside them.  It
   does its own bookkeeping for every request (a deque of requests in
   service, the clock, the keys), which costs about as much as shmwheel's
   pair and pulls every ratio towards 1.  On a shared machine one pair of
   runs half a minute apart can differ by a third whatever is measured (the
   host takes CPU time when it likes: the report gives how much it stole);
   runs seconds apart, taken several times, are what compares.  The two
   heapq runs share nothing, so their ratio is what this machine gives a
   second process running the same loop: the ceiling for shmwheel's.

Every comparison is a ratio within this run: the machine is shared, and
only figures taken minutes apart on it compare.  Throughput ratios are
shmwheel's over the peer's; cost ratios are the peer's over shmwheel's.  The
targets of the issue are printed next to the figures, never asserted.  The
round trip of one byte through a pipe to another process and back is
measured too: every server-based peer pays at least that on each call.

Output: a Markdown report on stdout, a progress bar on stderr, and with
``--out FILE.json`` its figures plus the machine (``--raw``: every sample
too), and a PNG plot next to it (``--plot`` to put it elsewhere): requests/s by number of producers, and the
lateness distribution of each backend with one producer.

A backend whose server is not installed (no ``redis-server`` on PATH) is
reported as skipped.  The exit status is 1 if any backend lost, duplicated
or fired early any timer, or fired a cancelled one: with ``--quick`` (about
40 s) this is the CI smoke test.

Clean-up: every segment is named ``shmwheel-bench-<pid>-<n>`` and unlinked,
and every process started here (producers, driver, pollers, servers) is
stopped, also on error, Ctrl-C or SIGTERM; the servers also die with this
process if it is killed.  Temporary files live in one directory that is
removed.

Usage::

    python bench/compare/run.py [--quick] [--out FILE.json] [--raw] [--plot FILE.png]
                                [--duration S] [--producers 1,2,4] [--skip-micro]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# micro.py and the helpers shared with driver.py (_common, _machine) are one
# folder up, in bench/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import micro
import psutil
import stress
from _common import Segments, distribution_ms, percentile, scratch, strict_json, terminate
from _machine import machine_info
from tqdm import tqdm

DURATION = 5.0  # s of load a run
QUICK_DURATION = 1.0
PRODUCERS = (1, 2, 4)
ROUNDS = 5  # back-to-back rounds behind each target's ratio
QUICK_ROUNDS = 1
PAIR_SECONDS = 1.0  # the tight pair loop of each backend
QUICK_PAIR_SECONDS = 0.3
QUICK_MICRO_REPEAT = 5

# The targets: printed next to the figures, never asserted.
TARGET_VS_REDIS = 100.0  # shmwheel pairs a producer / a Redis sorted set's
TARGET_VS_ASYNCIO = 2.0  # shmwheel pairs a producer / in-process asyncio's
TARGET_SCALING = 1.6  # shmwheel with 2 producers / with 1, in all

CDF_POINTS = 100  # quantiles of lateness kept for the plot and the JSON


@dataclass
class Goal:
    """One of the issue's targets, measured."""

    key: str
    label: str
    value: float | None  # None: could not be measured (a peer skipped)
    bound: float
    note: str = ""

    @property
    def met(self) -> bool | None:
        return None if self.value is None else self.value >= self.bound


# -- running ----------------------------------------------------------------------------------


@dataclass
class Round:
    """The runs behind the targets' ratios, back to back."""

    one: stress.StressRun  # shmwheel, 1 producer
    two: stress.StressRun  # shmwheel, 2 producers
    asyncio: stress.StressRun | None  # 1 producer; None if asyncio was not run
    private_one: stress.StressRun | None  # heapq, 1 producer
    private_two: stress.StressRun | None  # heapq, 2 producers, each with its own heap
    pairs: dict[str, float]  # backend -> ns per add+cancel pair in the bare loop, this round

    def runs(self) -> list[stress.StressRun]:
        every = (self.one, self.two, self.asyncio, self.private_one, self.private_two)
        return [r for r in every if r is not None]

    @property
    def scaling(self) -> float | None:
        return ratio(self.two.total_per_s, self.one.total_per_s)

    @property
    def vs_asyncio(self) -> float | None:
        """Requests a producer in the request loop, shmwheel / asyncio."""
        return ratio(self.one.per_producer_per_s, self.asyncio.per_producer_per_s if self.asyncio else None)

    @property
    def pair_vs_asyncio(self) -> float | None:
        """Add+cancel pairs in the bare loop, shmwheel / asyncio (a cost ratio: asyncio's ns over shmwheel's)."""
        return ratio(self.pairs.get("asyncio"), self.pairs.get("shmwheel"))

    @property
    def efficiency(self) -> float | None:
        """Requests per producer CPU-second, x2 / x1: what sharing the segment costs
        each producer, apart from how much CPU the producers got."""
        return ratio(self.two.per_producer_cpu_second, self.one.per_producer_cpu_second)

    @property
    def machine_scaling(self) -> float | None:
        """2 producers / 1 with nothing shared: what the machine allows."""
        if self.private_one is None or self.private_two is None:
            return None
        return ratio(self.private_two.total_per_s, self.private_one.total_per_s)

    @property
    def steal(self) -> float:
        """Share of the machine's CPU time the hypervisor took during the round's runs."""
        runs = self.runs()
        return sum(r.cpu.steal for r in runs) / max(1e-9, sum(r.cpu.capacity for r in runs))


@dataclass
class Results:
    micro: list[tuple[str, list[micro.Result]]]
    micro_cfg: micro.Config
    round_trip_ns: float
    pairs: dict[str, float]  # backend -> ns per add+cancel pair, tight loop
    runs: list[stress.StressRun]
    skipped: dict[str, str]  # backend -> why
    labels: dict[str, str]  # backend -> what it is
    rounds: list[Round] = field(default_factory=list)

    def every_run(self) -> list[stress.StressRun]:
        """The table's runs and the rounds': all of them are checked for exactly-once delivery."""
        extra = [r for x in self.rounds for r in x.runs()]
        return self.runs + extra


def run_all(args: argparse.Namespace, segs: Segments, tmp: str) -> Results:
    duration = args.duration or (QUICK_DURATION if args.quick else DURATION)
    pair_seconds = QUICK_PAIR_SECONDS if args.quick else PAIR_SECONDS
    rounds = QUICK_ROUNDS if args.quick else ROUNDS
    backends = stress.all_backends(segs)
    remote = [b for b in backends if not b.in_process]
    steps = (0 if args.skip_micro else 1) + 1 + len(backends) + len(remote) * len(args.producers) + 2 + rounds
    cfg = micro.QUICK if args.quick else micro.FULL
    if args.quick:
        cfg = micro.Config(**{**asdict(cfg), "repeat": QUICK_MICRO_REPEAT})
    results = Results([], cfg, math.nan, {}, [], {}, {b.name: b.label for b in backends})

    with tqdm(total=steps, file=sys.stderr, unit="step", dynamic_ncols=True) as bar:
        if not args.skip_micro:
            bar.set_description("micro-benchmark")
            results.micro = micro.run(cfg, 1, segs)
            bar.update()
        bar.set_description("pipe round trip")
        results.round_trip_ns = stress.round_trip_ns()
        bar.update()

        started: list[stress.Backend] = []
        try:
            for b in backends:
                bar.set_description(f"starting {b.name}")
                try:
                    b.start(tmp)
                except stress.Skipped as why:
                    results.skipped[b.name] = str(why)
                    b.stop()
                    bar.update(1 + (0 if b.in_process else len(args.producers)))
                    continue
                started.append(b)
                bar.set_description(f"{b.name}: add+cancel pairs")
                results.pairs[b.name] = stress.tight_pairs(b, pair_seconds)
                bar.update()
            run = 0
            for n in args.producers:
                for b in started:
                    if b.in_process and n != 1:
                        continue
                    bar.set_description(f"{b.name}, {n} producer{'s' if n > 1 else ''}")
                    results.runs.append(stress.run_stress(b, n, duration, run, tmp))
                    run += 1
                    bar.update()
            by_name = {b.name: b for b in started}

            def once(name: str, producers: int) -> stress.StressRun | None:
                nonlocal run
                if name not in by_name:
                    return None
                run += 1
                return stress.run_stress(by_name[name], producers, duration, run, tmp)

            for i in range(rounds):
                bar.set_description(f"round {i + 1} of {rounds}: pairs, shmwheel x1, x2, asyncio, heapq x1, x2")
                # The two bare loops side by side, first one then the other
                # in turn, so that a drift of the machine favours neither.
                order = ["shmwheel", "asyncio"][:: 1 if i % 2 == 0 else -1]
                pairs = {name: stress.tight_pairs(by_name[name], pair_seconds) for name in order if name in by_name}
                one, two = once("shmwheel", 1), once("shmwheel", 2)
                assert one is not None and two is not None  # shmwheel is never skipped
                results.rounds.append(
                    Round(one, two, once("asyncio", 1), once("heapq", 1), once("heapq", 2), pairs=pairs)
                )
                bar.update()
            bar.update(bar.total - bar.n)
        finally:
            for b in started:
                b.stop()
    return results


# -- figures ----------------------------------------------------------------------------------


def find(results: Results, backend: str, producers: int) -> stress.StressRun | None:
    for r in results.runs:
        if r.backend == backend and r.producers == producers:
            return r
    return None


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def median(xs: Sequence[float]) -> float | None:
    ordered = sorted(xs)
    n = len(ordered)
    if not n:
        return None
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def over_rounds(results: Results, what: str) -> tuple[float | None, str]:
    """The median of a Round property over the rounds, and a note with every value."""
    values = [v for x in results.rounds if (v := getattr(x, what)) is not None]
    if not values:
        return None, ""
    return median(values), "rounds: " + ", ".join(f"{v:.2f}x" for v in values)


def targets(results: Results) -> list[Goal]:
    one = find(results, "shmwheel", 1)

    def per_producer(backend: str) -> float | None:
        r = find(results, backend, 1)
        return None if r is None else r.per_producer_per_s

    def skipped(peer: str) -> str:
        return f"skipped: {results.skipped[peer]}" if peer in results.skipped else ""

    mine = None if one is None else one.per_producer_per_s
    every = results.every_run()
    bad = [r for r in every if not r.delivery.ok]
    steal = "CPU time stolen in the rounds: " + ", ".join(f"{100 * x.steal:.0f} %" for x in results.rounds)
    vs_redis_loop = ratio(mine, per_producer("redis"))
    pair_vs_asyncio, pair_vs_asyncio_note = over_rounds(results, "pair_vs_asyncio")
    loop_vs_asyncio, loop_values = over_rounds(results, "vs_asyncio")
    loop_note = "" if loop_vs_asyncio is None else f"in the request loop: median {loop_vs_asyncio:.2f}x ({loop_values})"
    scaling, scaling_note = over_rounds(results, "scaling")
    scaling_note += "; " + steal
    ceiling, _ = over_rounds(results, "machine_scaling")
    efficiency, _ = over_rounds(results, "efficiency")
    if efficiency is not None:
        scaling_note += f"; requests per producer CPU-second, x2 / x1: {efficiency:.2f}"
    if ceiling is not None:
        scaling_note += f"; the same loop with nothing shared (heapq): {ceiling:.2f}x"

    return [
        Goal(
            "vs_redis",
            "add+cancel pairs a producer: shmwheel / Redis sorted set (bare loop)",
            ratio(results.pairs.get("redis"), results.pairs.get("shmwheel")),
            TARGET_VS_REDIS,
            skipped("redis")
            or ("" if vs_redis_loop is None else f"in the request loop, requests/s a producer: {vs_redis_loop:,.1f}x"),
        ),
        Goal(
            "vs_asyncio",
            "add+cancel pairs a producer: shmwheel / in-process asyncio (bare loop, median of the rounds)",
            pair_vs_asyncio,
            TARGET_VS_ASYNCIO,
            "; ".join(
                filter(
                    None,
                    [
                        pair_vs_asyncio_note,
                        loop_note,
                        steal,
                    ],
                )
            ),
        ),
        Goal(
            "scaling_2",
            f"shmwheel requests/s in all, 2 producers / 1 producer ({os.cpu_count()} CPUs)",
            scaling,
            TARGET_SCALING,
            scaling_note,
        ),
        Goal(
            "delivery",
            "runs without a lost, duplicated, unexpected or early fire",
            float(len(every) - len(bad)),
            float(len(every)),
            "failed: " + ", ".join(f"{r.backend} x{r.producers}" for r in bad) if bad else "every backend",
        ),
    ]


def lateness_ms(r: stress.StressRun) -> dict[str, float]:
    return distribution_ms(r.lateness_ns)


def cdf_ms(ordered_ns: Sequence[int]) -> list[list[float]]:
    """(quantile %, lateness ms) at CDF_POINTS points, for the plot."""
    if not ordered_ns:
        return []
    qs = [100 * (i + 1) / CDF_POINTS for i in range(CDF_POINTS)]  # as in the JSON's config.lateness_cdf_pct
    return [[q, percentile(ordered_ns, q) / 1e6] for q in qs]


# -- report -----------------------------------------------------------------------------------


def human_bytes(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def stress_table(results: Results) -> list[str]:
    lines = [
        "| backend | producers | requests/s a producer | requests/s in all | shmwheel / this "
        "| lateness p50 / p99 / p99.9 ms | lost / dup. | consumer CPU | server CPU | timer memory |",
        "|:---|---:|---:|---:|---:|---:|:---:|---:|---:|---:|",
    ]
    for r in sorted(results.runs, key=lambda r: (r.producers, list(results.labels).index(r.backend))):
        base = find(results, "shmwheel", r.producers)
        if r.backend == "shmwheel":
            vs = "1"
        else:
            x = ratio(base.total_per_s if base else None, r.total_per_s)
            vs = "" if x is None else f"{x:,.1f}x" + (" (lower bound)" if r.backend in ("asyncio", "heapq") else "")
        late = lateness_ms(r)
        d = r.delivery
        dup = d.duplicated + d.unexpected
        consumer = "in the producer" if r.backend in ("asyncio", "heapq") else f"{100 * r.cpu_share('consumer'):.0f} %"
        servers = [k for k in r.cpu.processes if k not in ("consumer", "this process") and not k.startswith("producer")]
        server = f"{100 * r.cpu_share(*servers):.0f} %" if servers else "none"
        memory = f"{human_bytes(r.memory_bytes)}" if r.memory_bytes else "in the producer"
        lines.append(
            f"| {r.backend} | {r.producers} | {r.per_producer_per_s:,.0f} | {r.total_per_s:,.0f} | {vs} "
            f"| {late['p50']:.2f} / {late['p99']:.2f} / {late['p99.9']:.2f} | {d.lost} / {dup} "
            f"| {consumer} | {server} | {memory} |"
        )
    for name, why in results.skipped.items():
        lines.append(f"| {name} | | skipped: {why} | | | | | | | |")
    return lines


def pair_table(results: Results) -> list[str]:
    lines = ["| backend | ns per add+cancel pair | this / shmwheel |", "|:---|---:|---:|"]
    mine = results.pairs.get("shmwheel")
    for name, ns in results.pairs.items():
        x = ratio(ns, mine)
        lines.append(f"| {name} | {ns:,.0f} | {'' if x is None else f'{x:,.1f}x'} |")
    return lines


def round_table(results: Results) -> list[str]:
    lines = [
        "| round | pair ns, shmwheel / asyncio | asyncio / shmwheel "
        "| shmwheel x1, requests/s | shmwheel x2, in all | x2 / x1 | producer CPUs x1, x2 "
        "| per producer CPU-second x2 / x1 | asyncio x1 | shmwheel / asyncio "
        "| heapq x1 | heapq x2, nothing shared | x2 / x1 | CPU time stolen |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ns(name: str, x: Round) -> str:
        return f"{x.pairs[name]:,.0f}" if name in x.pairs else "skipped"

    def rate(r: stress.StressRun | None) -> str:
        return "skipped" if r is None else f"{r.total_per_s:,.0f}"

    def times(x: float | None) -> str:
        return "" if x is None else f"{x:.2f}x"

    for i, x in enumerate(results.rounds, 1):
        lines.append(
            f"| {i} | {ns('shmwheel', x)} / {ns('asyncio', x)} | {times(x.pair_vs_asyncio)} "
            f"| {rate(x.one)} | {rate(x.two)} | {times(x.scaling)} "
            f"| {x.one.producer_cpu:.2f}, {x.two.producer_cpu:.2f} | {times(x.efficiency)} "
            f"| {rate(x.asyncio)} | {times(x.vs_asyncio)} "
            f"| {rate(x.private_one)} | {rate(x.private_two)} | {times(x.machine_scaling)} | {100 * x.steal:.0f} % |"
        )
    return lines


def target_table(ts: list[Goal]) -> list[str]:
    lines = ["| target | measured | wanted | met | note |", "|:---|---:|---:|:---:|:---|"]
    for t in ts:
        if t.key == "delivery":
            value, bound = f"{t.value:.0f} of {t.bound:.0f}", "all"
        else:
            value = "" if t.value is None else f"{t.value:,.2f}x"
            bound = f">= {t.bound:g}x"
        met = {True: "yes", False: "**no**", None: "n/a"}[t.met]
        lines.append(f"| {t.label} | {value} | {bound} | {met} | {t.note} |")
    return lines


def markdown(results: Results, ts: list[Goal], machine: dict[str, Any], duration: float, quick: bool) -> str:
    one = find(results, "shmwheel", 1)
    lines = [
        f"## shmwheel and the timers users pick today ({'quick' if quick else 'full'} run)",
        "",
        f"- CPU: {machine['cpu']}, {machine['cpus']} logical CPUs; {machine['os']}",
        f"- Python: {machine['python']}, cffi {machine['cffi']}, shmwheel {machine['shmwheel']}, "
        f"redis-py {machine['redis-py']}, {machine['redis-server']}",
        f"- Workload: each producer process runs request timeouts flat out for {duration:g} s: add a timer "
        f"due in {stress.REQUEST_TIMEOUT_NS / 1e9:g} s, cancel it {stress.SERVICE_TIME_NS / 1e6:g} ms later; "
        f"every {stress.FIRE_EVERY}th request hangs and its timer ({stress.HANG_TIMEOUT_NS / 1e6:g} ms) fires. "
        "A request is one add and one cancel (a pair).",
        f"- Lateness: from the deadline to the moment the fire reaches Python in the consumer (shmwheel: its "
        f"driver's handler; Redis, the Manager and the socket heap: a poller claiming every "
        f"{stress.POLL_INTERVAL_NS / 1e6:g} ms; asyncio and heapq: the producer's own loop, every "
        f"{stress.POLL_INTERVAL_NS / 1e6:g} ms).",
        f"- One byte to another process and back through pipes: {results.round_trip_ns / 1e3:,.1f} us here, "
        "the least a server round trip costs on this machine.",
        "",
        "### Targets",
        "",
        *target_table(ts),
        "",
        "The targets about add+cancel pairs are taken in a bare loop from one process, through the same "
        "adapters as the request loop; the request loop's own figures are in the notes. The ratios to asyncio "
        "and of 2 producers to 1 are medians over rounds, each made of the bare loops of shmwheel and asyncio "
        f"side by side (in turn first), then request-loop runs back to back ({duration:g} s each); the table "
        "below has the rounds. heapq x2 is two producers with a heap each, "
        "nothing shared: what this machine gives a second process running the same loop. CPU time stolen is "
        "the share of the machine's CPU time the hypervisor gave to other guests during the round.",
        "",
        *round_table(results),
        "",
        "### The request-timeout workload",
        "",
        *stress_table(results),
        "",
        "asyncio and heapq run in the producer's own process, one producer: they cannot cross processes, so "
        "they are lower bounds for what any shared timer costs, not alternatives for several workers.",
    ]
    if one is not None and one.fired_at_lateness_ns:
        fa = distribution_ms(one.fired_at_lateness_ns)
        lines.append(
            f"shmwheel's own stamp (fired_at, set by the driver's clock thread), 1 producer: p50 / p99 / p99.9 "
            f"{fa['p50']:.2f} / {fa['p99']:.2f} / {fa['p99.9']:.2f} ms."
        )
    lines += ["", "### The add+cancel pair alone, from one process", "", *pair_table(results), ""]
    if results.micro:
        lines += [micro.markdown(results.micro_cfg, machine, results.micro).replace("## ", "### ", 1)]
    return "\n".join(lines)


def plot(results: Results, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name in results.labels:
        runs = sorted((r for r in results.runs if r.backend == name), key=lambda r: r.producers)
        if not runs:
            continue
        xs, ys = [r.producers for r in runs], [r.total_per_s for r in runs]
        if name in ("asyncio", "heapq"):
            left.plot(xs, ys, marker="x", linestyle="none", markersize=9, label=f"{name} (in-process, 1 producer)")
        else:
            left.plot(xs, ys, marker="o", label=name)
        one = runs[0]
        if one.lateness_ns:
            cdf = cdf_ms(one.lateness_ns)
            right.plot([max(v, 1e-3) for _, v in cdf], [q for q, _ in cdf], label=f"{name} ({one.producers} prod.)")
    left.set(xlabel="producer processes", ylabel="requests/s in all (add + cancel)", yscale="log")
    left.set_xticks(list(PRODUCERS))
    left.set_title("Throughput by number of producers")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    right.set(xlabel="lateness: deadline to consumer, ms (log)", ylabel="percent of fires", xscale="log")
    right.set_title("Lateness distribution, 1 producer")
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def document(results: Results, ts: list[Goal], machine: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    duration = args.duration or (QUICK_DURATION if args.quick else DURATION)

    def run_doc(r: stress.StressRun, cdf: bool = True) -> dict[str, Any]:
        return {
            "backend": r.backend,
            "producers": r.producers,
            "duration_s": r.duration,
            "requests": r.requests,
            "requests_per_s_total": r.total_per_s,
            "requests_per_s_per_producer": r.per_producer_per_s,
            "lateness_ms": lateness_ms(r),
            # At the quantiles of config.lateness_cdf_pct, to the microsecond: a thousandth of a tick.
            **({"lateness_cdf_ms": [round(v, 3) for _, v in cdf_ms(r.lateness_ns)]} if cdf else {}),
            "fired_at_lateness_ms": distribution_ms(r.fired_at_lateness_ns) if r.fired_at_lateness_ns else None,
            "delivery": asdict(r.delivery),
            "cpu_s": r.cpu.processes,
            "machine_busy_s": r.cpu.busy,
            "machine_steal_s": r.cpu.steal,
            "machine_cpu_s": r.cpu.capacity,
            "memory_bytes": r.memory_bytes,
            "memory_note": r.memory_note,
            "pending_at_end": r.pending_at_end,
        }

    rounds = [
        {
            "scaling_2": x.scaling,
            "vs_asyncio": x.vs_asyncio,
            "pair_vs_asyncio": x.pair_vs_asyncio,
            "pairs_ns": x.pairs,
            "efficiency_2": x.efficiency,
            "producer_cpus": [x.one.producer_cpu, x.two.producer_cpu],
            "steal_share": x.steal,
            "machine_scaling_2": x.machine_scaling,
            "runs": [run_doc(r, cdf=False) for r in x.runs()],
        }
        for x in results.rounds
    ]
    return {
        "machine": machine,
        "config": {
            "quick": args.quick,
            "duration_s": duration,
            "producers": list(args.producers),
            "service_time_ns": stress.SERVICE_TIME_NS,
            "request_timeout_ns": stress.REQUEST_TIMEOUT_NS,
            "hang_timeout_ns": stress.HANG_TIMEOUT_NS,
            "fire_every": stress.FIRE_EVERY,
            "poll_interval_ns": stress.POLL_INTERVAL_NS,
            "tick_s": stress.TICK,
            "rounds": len(results.rounds),
            "lateness_cdf_pct": [100 * (i + 1) / CDF_POINTS for i in range(CDF_POINTS)],
            "micro": asdict(results.micro_cfg) if results.micro else None,
        },
        "ok": all(r.delivery.ok for r in results.every_run()),
        "targets": [{**asdict(t), "met": t.met} for t in ts],
        "round_trip_ns": results.round_trip_ns,
        "pairs_ns": results.pairs,
        "stress": [run_doc(r) for r in results.runs],
        "rounds": rounds,
        "skipped": results.skipped,
        "micro": [
            {"section": title, **asdict(x), "samples": [round(v, 1) for v in x.samples], "meets": x.meets}
            for title, rows in results.micro
            for x in rows
        ],
    }


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` without its raw samples: every figure the report prints, no more.

    What goes: each micro-benchmark case's repetitions (its minimum stays),
    each run's lateness at every percentile (p50 to max stay), and the runs
    inside each round but for their requests/s in all (the round's ratios
    stay).
    """

    def round_summary(x: dict[str, Any]) -> dict[str, Any]:
        rates = {f"{r['backend']} x{r['producers']}": r["requests_per_s_total"] for r in x["runs"]}
        return {**{k: v for k, v in x.items() if k != "runs"}, "requests_per_s_total": rates}

    return {
        **doc,
        "config": {k: v for k, v in doc["config"].items() if k != "lateness_cdf_pct"},
        "stress": [{k: v for k, v in r.items() if k != "lateness_cdf_ms"} for r in doc["stress"]],
        "rounds": [round_summary(x) for x in doc["rounds"]],
        "micro": [{k: v for k, v in x.items() if k != "samples"} for x in doc["micro"]],
    }


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs and no 10 M level: the CI smoke test")
    parser.add_argument(
        "--out", metavar="FILE.json", help="write the figures of the report to FILE.json, and the plot beside it"
    )
    parser.add_argument(
        "--raw", action="store_true", help="with --out: also every sample (repetitions, percentiles, each round's runs)"
    )
    parser.add_argument("--plot", metavar="FILE.png", help="where the plot goes (default: beside --out)")
    parser.add_argument(
        "--duration", type=float, metavar="S", help=f"s of load a run (default {DURATION:g}, {QUICK_DURATION:g} quick)"
    )
    parser.add_argument(
        "--producers",
        default=",".join(map(str, PRODUCERS)),
        metavar="N,N,...",
        help="numbers of producer processes (default 1,2,4)",
    )
    parser.add_argument("--skip-micro", action="store_true", help="leave out the micro-benchmark")
    args = parser.parse_args(argv)
    try:
        args.producers = tuple(sorted({int(n) for n in args.producers.split(",")}))
    except ValueError:
        parser.error("--producers takes numbers separated by commas")
    if not args.producers or not all(1 <= n <= 64 for n in args.producers):
        parser.error("--producers must be between 1 and 64")
    if 1 not in args.producers:
        parser.error("--producers must include 1: every ratio is taken against one producer")
    if args.raw and not args.out:
        parser.error("--raw goes with --out")
    if args.duration is not None and not 0 < args.duration <= 600:
        parser.error("--duration must be more than 0 and at most 600 s")
    return args


def redis_versions() -> dict[str, str]:
    try:
        import redis

        client = redis.__version__
    except ImportError:
        client = "not installed"
    exe = shutil.which("redis-server")
    server = "no redis-server"
    if exe is not None:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False).stdout.split()
        server = "redis-server " + next((w[2:] for w in out if w.startswith("v=")), "?")
    return {"redis-py": client, "redis-server": server}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, terminate)
    segs = Segments()
    started = time.monotonic()
    try:
        with scratch(segs, "shmwheel-bench-run-") as tmp:
            results = run_all(args, segs, tmp)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    wall = time.monotonic() - started

    machine = machine_info(psutil=psutil.__version__, **redis_versions())
    ts = targets(results)
    duration = args.duration or (QUICK_DURATION if args.quick else DURATION)
    print(markdown(results, ts, machine, duration, args.quick))
    print(f"\n(ran in {wall:.0f} s)")
    if args.out:
        doc = document(results, ts, machine, args)
        doc["wall_s"] = wall
        if not args.raw:
            doc = summary(doc)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(strict_json(doc), f, indent=1, allow_nan=False)
            f.write("\n")
    plot_path = args.plot or (os.path.splitext(args.out)[0] + ".png" if args.out else None)
    if plot_path:
        plot(results, plot_path)
    if not all(r.delivery.ok for r in results.every_run()):
        print("FAILED: a backend lost, duplicated or misfired timers (see the table)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
