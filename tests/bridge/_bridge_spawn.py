"""Process groups for the PyTorch bridge's tests: a one-rank group in this process, and
spawned groups of several ranks.

`worker(rank, world, ...)` runs every scenario of tests/bridge/_bridge_scenarios.py on one
rank of a spawned group (gloo on CPU, NCCL on CUDA), then the checks only a group of
several ranks has (collective counts, unequal shards, T = 0, torch.compile with TP), and
writes the failures to a JSON file, so that all TP scenarios of one world size share one
process start-up (importing torch + jax + megatron takes seconds).
Nothing heavy is imported at module level: spawned children import this module first.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import time
import traceback

from _bridge_scenarios import (
    V_LOCAL, Scenario, load_megatron, make_inputs, run_scenario, scenarios,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_rank_group(backend: str, timeout_s: float):
    """A one-rank process group of `backend` (Megatron needs a group even for TP = 1).
    Starts the default (gloo) group if nothing has, and then also destroys it."""
    import torch.distributed as dist

    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
        created = True
    try:
        yield dist.new_group([0], backend=backend)
    finally:
        if created:
            dist.destroy_process_group()


class CollectiveCounter:
    """Counts torch.distributed collectives (monkeypatched module functions)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
             "reduce_scatter_tensor", "broadcast", "all_to_all", "all_to_all_single",
             "reduce", "gather", "scatter", "barrier")

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.count = 0
        self.saved = {}

    def __enter__(self):
        for name in self.NAMES:
            orig = getattr(self.dist, name)
            self.saved[name] = orig

            def wrapped(*a, _orig=orig, **k):
                self.count += 1
                return _orig(*a, **k)

            setattr(self.dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self.saved.items():
            setattr(self.dist, name, orig)


def _extra_checks(rank, world, group, device, timings):
    """Collective counts, unequal shards, T = 0, compile (TP = 2): returns failures."""
    import torch

    import bridge
    from bridge import _jaxfns

    failures = []

    def check(name, fn):
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:
            failures.append(f"[rank {rank}] {name}: {traceback.format_exc(limit=6)}")
        timings[name] = time.perf_counter() - t0

    def collectives():
        import torch.distributed as dist

        fresh = dist.new_group(list(range(world)))  # a group the bridge has not seen
        counts = []
        for num_tokens in (5, 6, 5):  # a new T needs no new check
            x = torch.randn(num_tokens, V_LOCAL, device=device, requires_grad=True)
            y = torch.randint(0, world * V_LOCAL, (num_tokens,),
                              generator=torch.Generator().manual_seed(1)).to(device)
            with CollectiveCounter() as c:
                lp, h = bridge.logprob_entropy(x, y, process_group=fresh)
            counts.append(c.count)
        with CollectiveCounter() as c:
            torch.autograd.grad([lp, h], x, [torch.ones_like(lp), torch.ones_like(h)])
        with CollectiveCounter() as opt_in:
            bridge.logprob_entropy(x, y, process_group=fresh, check_targets=True)
        assert (counts, c.count, opt_in.count) == ([2, 1, 1], 0, 2), (
            f"collectives: forwards {counts} (want 2 on the group's first call: shard "
            f"check + all-gather, then 1 whatever T), backward {c.count} (want 0), "
            f"check_targets=True {opt_in.count} (want 2: shard check every call)")

    def unequal_shards():
        v_loc = V_LOCAL + (1 if rank == world - 1 else 0)
        x = torch.randn(4, v_loc, device=device)
        y = torch.zeros(4, dtype=torch.long, device=device)
        calls = []
        orig = _jaxfns.local_forward
        _jaxfns.local_forward = lambda **k: calls.append(k) or orig(**k)
        try:  # the group is not new: only the opt-in check runs the collective shape check
            bridge.logprob_entropy(x, y, process_group=group, check_targets=True)
        except ValueError as err:
            assert "same shape" in str(err) and "V_loc" in str(err), str(err)
        else:
            raise AssertionError("unequal vocabulary shards were accepted")
        finally:
            _jaxfns.local_forward = orig
        assert not calls, "a kernel ran before the shard-size error"

    def empty():
        x = torch.randn(0, V_LOCAL, device=device, requires_grad=True)
        y = torch.zeros(0, dtype=torch.long, device=device)
        with CollectiveCounter() as c:
            lp, h = bridge.logprob_entropy(x, y, process_group=group)
            (g,) = torch.autograd.grad(lp.sum() + h.sum(), x)
        assert c.count == 0, f"T = 0 ran {c.count} collectives"
        assert lp.shape == (0,) and h.shape == (0,) and g.shape == (0, V_LOCAL)
        lp2, h2 = bridge.calculate_log_probs_and_entropy(x, y, group, with_entropy=True)
        assert lp2.shape == (0,) and h2.shape == (0,), (lp2.shape, h2.shape)

    def compiled():
        sc = Scenario("float32", True, "grad", "bridge", temperature=0.8)
        x_full, y, mask_full, g_lp, g_h = make_inputs(sc, world, device, seed=5)
        cols = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
        x = x_full[:, cols].contiguous().requires_grad_()
        mask = mask_full[:, cols].contiguous()

        def loss(x, y, mask, g_lp, g_h):
            lp, h = bridge.logprob_entropy(x, y, process_group=group, keep_mask=mask,
                                           temperature=0.8)
            return (lp * g_lp).sum() + (h * g_h).sum(), lp, h

        import torch._dynamo

        torch._dynamo.reset()
        c_loss, c_lp, c_h = torch.compile(loss, fullgraph=True)(x, y, mask, g_lp, g_h)
        (c_g,) = torch.autograd.grad(c_loss, x)
        e_loss, e_lp, e_h = loss(x, y, mask, g_lp, g_h)
        (e_g,) = torch.autograd.grad(e_loss, x)
        assert torch.allclose(c_lp, e_lp, rtol=0, atol=1e-6), "compiled log_prob differs"
        assert torch.allclose(c_h, e_h, rtol=0, atol=1e-6), "compiled entropy differs"
        assert torch.allclose(c_g, e_g, rtol=0, atol=1e-6), "compiled gradient differs"

    check("collective count", collectives)
    check("unequal shards", unequal_shards)
    check("T = 0", empty)
    if world == 2:
        check("torch.compile(fullgraph=True) with TP", compiled)
    return failures


def worker(rank: int, world: int, port: int, out_dir: str, backend: str, full: bool):
    """One rank of a spawned group: every scenario, then the extra checks."""
    if backend == "gloo":  # CPU: compile time dominates these tiny checks
        os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                              "--xla_cpu_multi_thread_eigen=false")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if backend == "gloo":
        torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    failures = []
    timings = {}
    t0 = time.perf_counter()
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        group = dist.new_group(list(range(world)))
        import bridge  # noqa: F401  (before anything else starts JAX)

        megatron = load_megatron()
        timings["start-up"] = time.perf_counter() - t0
        for sc in scenarios(full):
            t1 = time.perf_counter()
            try:
                run_scenario(sc, group=group, meg_group=group, rank=rank, world=world,
                             device=device, megatron=megatron)
            except Exception:
                failures.append(f"[rank {rank}] {sc.name}: {traceback.format_exc(limit=8)}")
            timings[sc.name] = time.perf_counter() - t1
        t1 = time.perf_counter()
        failures += _extra_checks(rank, world, group, device, timings)
        timings["extra"] = time.perf_counter() - t1
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        failures.append(f"[rank {rank}] worker: {traceback.format_exc()}")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "failures": failures, "timings_s": timings,
                   "scenarios": len(scenarios(full))}, fh)


def spawn(world: int, out_dir: str, backend: str = "gloo", full: bool = True) -> list[str]:
    """Run `worker` on `world` spawned ranks; return all failures."""
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(world, free_port(), out_dir, backend, full), nprocs=world,
             join=True)
    failures, results = rank_results(world, out_dir)
    for result in results.values():
        failures += result["failures"]
    return failures


def rank_results(world: int, out_dir: str) -> tuple[list[str], dict]:
    """The ranks' result files (`out_dir/rank<r>.json`): a failure for each rank that
    wrote none, and {rank: its result} for the others."""
    failures, results = [], {}
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if not os.path.exists(path):
            failures.append(f"rank {rank} wrote no result")
            continue
        with open(path) as fh:
            results[rank] = json.load(fh)
    return failures, results
