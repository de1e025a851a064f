"""Vocab-parallel log-prob and entropy across hosts, with JAX's own distributed runtime.

The same script runs on one process or many; only the launch differs.

One process, 8 fake CPU devices (CI, a laptop):

    python examples/multihost.py --cpu-devices 8

Two processes on one machine, 4 fake CPU devices each (JAX's CPU collectives, gloo):

    python examples/multihost.py --cpu-devices 4 --coordinator 127.0.0.1:12355 \
        --num-processes 2 --process-id 0 &
    python examples/multihost.py --cpu-devices 4 --coordinator 127.0.0.1:12355 \
        --num-processes 2 --process-id 1

GPU hosts, one process per host driving all its GPUs (NCCL):

    # on host i of N (host 0 runs the coordinator):
    python examples/multihost.py --coordinator host0:12355 --num-processes N --process-id i
    # under SLURM or Open MPI, jax.distributed.initialize() finds all three itself:
    srun python examples/multihost.py --distributed

Every process runs the same program (SPMD): it calls `jax.distributed.initialize()`
before any other JAX call, builds one mesh over *all* devices of all processes
(`jax.devices()`), and works on global `jax.Array`s of which it holds only its
own shards. The mesh here is `(dp, tp)`: the vocabulary is split over `tp` (by
default the devices of one host, where a tensor-parallel group usually lives)
and tokens over `dp` (by default across hosts). The script checks the sharded
results and gradient against the unsharded op on the full data and exits
non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-devices", type=int, default=0,
                        help="run on N fake CPU devices per process (no accelerator needed)")
    parser.add_argument("--coordinator", default=None,
                        help="host:port of process 0 (jax.distributed.initialize)")
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--process-id", type=int, default=None)
    parser.add_argument("--distributed", action="store_true",
                        help="call jax.distributed.initialize() even without the three "
                             "arguments above (SLURM / Open MPI / TPU auto-detection)")
    parser.add_argument("--tp", type=int, default=None,
                        help="vocabulary shards (default: devices per process)")
    parser.add_argument("--tokens", type=int, default=64, help="global number of tokens")
    parser.add_argument("--vocab", type=int, default=512, help="global vocabulary size")
    parser.add_argument("--implementation", default=None, choices=[None, "xla", "pallas"])
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_devices:
        # Both must be set before JAX initialises its backends.
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_"
                                   f"platform_device_count={args.cpu_devices}").strip()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jaxops

    multi = args.distributed or args.num_processes not in (None, 1)
    if multi:
        # JAX's distributed runtime: process discovery, then global devices and
        # cross-process collectives (NCCL on GPU, gloo on CPU). Must come first.
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.num_processes,
                                   process_id=args.process_id)
    me = jax.process_index()

    def say(*parts):
        print(f"[process {me}/{jax.process_count()}]", *parts, flush=True)

    tp = args.tp or jax.local_device_count()
    dp = jax.device_count() // tp
    if dp * tp != jax.device_count():
        raise SystemExit(f"--tp {tp} must divide the {jax.device_count()} devices")
    mesh = jax.make_mesh((dp, tp), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    say(f"{jax.device_count()} devices ({jax.local_device_count()} here), mesh dp={dp} tp={tp}")

    # The full problem, generated identically on every process from one seed
    # (at real sizes the logits come out of the model already sharded, and no
    # process ever holds them whole).
    rng = np.random.default_rng(0)
    logits_np = rng.normal(0.0, 3.0, (args.tokens, args.vocab)).astype(np.float32)
    targets_np = rng.integers(0, args.vocab, args.tokens).astype(np.int32)
    mask_np = rng.random((args.tokens, args.vocab)) < 0.2

    def global_array(host_array, spec):
        # Each process materialises only the shards its own devices hold.
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(host_array.shape, sharding,
                                            lambda index: host_array[index])

    logits = global_array(logits_np, P("dp", "tp"))
    targets = global_array(targets_np, P("dp"))
    keep_mask = global_array(mask_np, P("dp", "tp"))

    options = dict(temperature=0.8, implementation=args.implementation)

    @jax.jit
    def loss_and_grad(logits, targets, keep_mask):
        def loss(logits):
            log_prob, entropy = jaxops.vocab_parallel_logprob_entropy(
                logits, targets, keep_mask=keep_mask, mesh=mesh, vocab_axis="tp",
                token_axis="dp", **options)
            return -jnp.mean(log_prob) - 0.01 * jnp.mean(entropy), (log_prob, entropy)

        return jax.value_and_grad(loss, has_aux=True)(logits)

    (loss, (log_prob, entropy)), grad = loss_and_grad(logits, targets, keep_mask)
    say(f"loss {float(loss):.6f}; gradient sharding {grad.sharding.spec}")

    # Check against the unsharded op on one local device, on every process.
    def full(x):
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    local = jax.local_devices()[0]

    # Arrays enter the jitted function as arguments: an array a jitted function closes
    # over is baked into the compiled program as a constant (the [T, V] mask included).
    @jax.jit
    def unsharded_loss_and_grad(logits, targets, keep_mask):
        def loss(logits):
            log_prob, entropy = jaxops.logprob_entropy(
                logits, targets, keep_mask=keep_mask, **options)
            return -jnp.mean(log_prob) - 0.01 * jnp.mean(entropy), (log_prob, entropy)

        return jax.value_and_grad(loss, has_aux=True)(logits)

    (want_loss, (want_lp, want_h)), want_grad = unsharded_loss_and_grad(
        *(jax.device_put(a, local) for a in (logits_np, targets_np, mask_np)))
    errors = {
        "loss": abs(float(loss) - float(want_loss)),
        "log_prob": float(np.max(np.abs(full(log_prob) - np.asarray(want_lp)))),
        "entropy": float(np.max(np.abs(full(entropy) - np.asarray(want_h)))),
        "grad": float(np.max(np.abs(full(grad) - np.asarray(want_grad)))
                      / np.max(np.abs(np.asarray(want_grad)))),
    }
    say("max error vs unsharded:", ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    ok = all(v <= 1e-5 for v in errors.values())
    say("OK" if ok else "MISMATCH")
    if multi:
        jax.distributed.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
