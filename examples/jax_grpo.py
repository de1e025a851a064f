"""GRPO on a toy task in pure JAX, with `jaxops.logprob_entropy` in the loss.

    python examples/jax_grpo.py [--iterations N] [--seed S]

A tiny autoregressive policy (embeddings + one residual MLP layer, hand-written
Adam; no flax/optax needed) answers each prompt token `a` with RESPONSE_LEN
tokens. The reward is the fraction of response tokens in the prompt's "bucket"
(`token // BUCKET == a % NUM_BUCKETS`), so the policy must learn to condition
on the prompt; a random policy scores 1 / NUM_BUCKETS.

Each iteration is one GRPO step, the way an RL framework runs it:

1. Rollout (the "inference engine"): sample GROUP responses per prompt with
   temperature TAU and top-p TOP_P, recording each token's log-probability
   under the renormalised nucleus and the nucleus itself (the keep mask).
2. Advantages: rewards normalised within each prompt's group.
3. PPO_EPOCHS gradient steps on the clipped policy loss with an entropy bonus,
   where the trainer's log-probs and entropies come from
   `jaxops.logprob_entropy(logits, tokens, keep_mask=nucleus, temperature=TAU)`.

Because the keep mask renormalises over the rollout's nucleus, the trainer's
log-probs match the rollout's to fp32 round-off on the first epoch (without
it they would be off by -log P(nucleus)). Within each batch the PPO loss goes
down; across iterations the reward goes up. The script exits non-zero unless
both happen and the log-probs match.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing it
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxops  # noqa: E402

VOCAB = 64
RESPONSE_LEN = 8
NUM_BUCKETS = 8
BUCKET = VOCAB // NUM_BUCKETS
HIDDEN = 64
PROMPTS = 32          # prompts per iteration
GROUP = 8             # responses per prompt (GRPO group)
TAU = 0.8             # rollout temperature
TOP_P = 0.95          # rollout top-p
CLIP = 0.2
ENTROPY_COEF = 0.01
PPO_EPOCHS = 4
LEARNING_RATE = 5e-3
BOS = VOCAB           # the "previous token" of the first response position


# ----------------------------------------------------------------------------- policy

def init_params(key):
    k = jax.random.split(key, 5)
    scale = HIDDEN ** -0.5
    return {
        "prompt": jax.random.normal(k[0], (VOCAB, HIDDEN)) * 0.5,
        "prev": jax.random.normal(k[1], (VOCAB + 1, HIDDEN)) * 0.5,
        "pos": jax.random.normal(k[2], (RESPONSE_LEN, HIDDEN)) * 0.5,
        "w1": jax.random.normal(k[3], (HIDDEN, HIDDEN)) * scale,
        "b1": jnp.zeros(HIDDEN),
        "out": jax.random.normal(k[4], (HIDDEN, VOCAB)) * scale * 0.1,  # near-uniform start
    }


def policy_logits(params, prompts, prev_tokens, positions):
    """Logits [..., VOCAB] for the next token given prompt, previous token and position."""
    h = params["prompt"][prompts] + params["prev"][prev_tokens] + params["pos"][positions]
    h = h + jnp.tanh(h @ params["w1"] + params["b1"])
    return h @ params["out"]


def teacher_forced_logits(params, prompts, responses):
    """[B, L, VOCAB] logits for every response position (previous tokens known)."""
    batch = responses.shape[0]
    prev = jnp.concatenate([jnp.full((batch, 1), BOS), responses[:, :-1]], axis=1)
    positions = jnp.broadcast_to(jnp.arange(RESPONSE_LEN), (batch, RESPONSE_LEN))
    return policy_logits(params, prompts[:, None], prev, positions)


# ----------------------------------------------------------------------------- rollout

def nucleus_mask(logits, temperature, top_p):
    """Bool mask of the top-p nucleus of softmax(logits / temperature), per row."""
    probs = jax.nn.softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    order = jnp.argsort(-probs, axis=-1)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(keep_sorted, inverse, axis=-1)


@jax.jit
def rollout(params, prompts, key):
    """Sample responses; return (responses [B, L], rollout log-probs [B, L], masks [B, L, V])."""
    batch = prompts.shape[0]

    def step(carry, position):
        prev, key = carry
        key, sub = jax.random.split(key)
        logits = policy_logits(params, prompts, prev, jnp.full((batch,), position))
        mask = nucleus_mask(logits, TAU, TOP_P)
        # The inference engine's own arithmetic: fp32, log-softmax over the nucleus.
        masked = jnp.where(mask, logits.astype(jnp.float32) / TAU, -jnp.inf)
        log_q = jax.nn.log_softmax(masked, axis=-1)
        token = jax.random.categorical(sub, masked, axis=-1)
        token_log_q = jnp.take_along_axis(log_q, token[:, None], axis=-1)[:, 0]
        return (token, key), (token, token_log_q, mask)

    _, (tokens, log_q, masks) = jax.lax.scan(
        step, (jnp.full((batch,), BOS), key), jnp.arange(RESPONSE_LEN))
    return tokens.T, log_q.T, jnp.swapaxes(masks, 0, 1)


def rewards_of(prompts, responses):
    """Fraction of response tokens in the prompt's bucket."""
    return jnp.mean(responses // BUCKET == (prompts % NUM_BUCKETS)[:, None], axis=-1)


def group_advantages(rewards):
    grouped = rewards.reshape(-1, GROUP)
    adv = (grouped - grouped.mean(-1, keepdims=True)) / (grouped.std(-1, keepdims=True) + 1e-6)
    return adv.reshape(-1)


# ----------------------------------------------------------------------------- loss

def grpo_loss(params, prompts, responses, old_log_probs, masks, advantages):
    logits = teacher_forced_logits(params, prompts, responses)
    log_probs, entropy = jaxops.logprob_entropy(
        logits, responses, keep_mask=masks, temperature=TAU)  # [B, L] each
    ratio = jnp.exp(log_probs - old_log_probs)
    adv = advantages[:, None]
    policy_loss = -jnp.mean(jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - CLIP, 1 + CLIP) * adv))
    loss = policy_loss - ENTROPY_COEF * jnp.mean(entropy)
    return loss, (log_probs, entropy)


def adam_init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"m": zeros, "v": zeros, "t": jnp.zeros((), jnp.int32)}


def adam_update(params, grads, state, lr=LEARNING_RATE, b1=0.9, b2=0.999, eps=1e-8):
    t = state["t"] + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    m_hat = jax.tree.map(lambda m: m / (1 - b1 ** t), m)
    v_hat = jax.tree.map(lambda v: v / (1 - b2 ** t), v)
    params = jax.tree.map(lambda p, m, v: p - lr * m / (jnp.sqrt(v) + eps), params, m_hat, v_hat)
    return params, {"m": m, "v": v, "t": t}


@jax.jit
def train_step(params, opt_state, batch):
    (loss, (log_probs, entropy)), grads = jax.value_and_grad(grpo_loss, has_aux=True)(
        params, *batch)
    params, opt_state = adam_update(params, grads, opt_state)
    return params, opt_state, loss, log_probs, entropy


@jax.jit
def batch_loss(params, batch):
    return grpo_loss(params, *batch)[0]


@jax.jit
def unmasked_log_probs(params, prompts, responses):
    logits = teacher_forced_logits(params, prompts, responses)
    return jaxops.logprob_entropy(logits, responses, temperature=TAU, with_entropy=False)[0]


# ----------------------------------------------------------------------------- main

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-keep-mask", action="store_true",
                        help="train without the rollout's top-p mask (log-probs then disagree)")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    key = jax.random.key(args.seed)
    key, init_key = jax.random.split(key)
    params = init_params(init_key)
    opt_state = adam_init(params)
    print(f"jax {jax.__version__} on {jax.default_backend()} (jaxops implementation "
          f"{jaxops.default_implementation()!r}); {PROMPTS} prompts x {GROUP} responses x "
          f"{RESPONSE_LEN} tokens, vocabulary {VOCAB}, temperature {TAU}, top-p {TOP_P}")

    history = []
    max_mismatch = 0.0
    for it in range(args.iterations):
        key, prompt_key, sample_key = jax.random.split(key, 3)
        prompts = jnp.repeat(jax.random.randint(prompt_key, (PROMPTS,), 0, VOCAB), GROUP)
        responses, old_log_probs, masks = rollout(params, prompts, sample_key)
        rewards = rewards_of(prompts, responses)
        advantages = group_advantages(rewards)
        batch = (prompts, responses, old_log_probs, None if args.no_keep_mask else masks,
                 advantages)

        losses = []
        for epoch in range(PPO_EPOCHS):
            params, opt_state, loss, log_probs, entropy = train_step(params, opt_state, batch)
            if epoch == 0:
                # Same weights as the rollout: the ratio must be 1 up to fp32 round-off.
                max_mismatch = max(max_mismatch, float(jnp.max(jnp.abs(log_probs - old_log_probs))))
            losses.append(float(loss))
        # The loss after the last update, on the same batch.
        losses.append(float(batch_loss(params, batch)))
        history.append((float(rewards.mean()), losses[0], losses[-1], float(entropy.mean())))
        print(f"iter {it:3d}  reward {history[-1][0]:.3f}  loss {losses[0]:+.4f} -> "
              f"{losses[-1]:+.4f} over {PPO_EPOCHS} PPO steps  entropy {history[-1][3]:.3f}")

    # What the mismatch would have been without the keep mask (rollout weights of the last batch
    # are gone; measure on a fresh rollout with the final weights).
    key, prompt_key, sample_key = jax.random.split(key, 3)
    prompts = jnp.repeat(jax.random.randint(prompt_key, (PROMPTS,), 0, VOCAB), GROUP)
    responses, old_log_probs, masks = rollout(params, prompts, sample_key)
    max_mismatch_unmasked = float(jnp.max(jnp.abs(
        unmasked_log_probs(params, prompts, responses) - old_log_probs)))

    rewards = np.array([h[0] for h in history])
    first_losses = np.array([h[1] for h in history])
    last_losses = np.array([h[2] for h in history])
    window = max(1, len(history) // 8)
    reward_start, reward_end = rewards[:window].mean(), rewards[-window:].mean()
    loss_start, loss_end = first_losses.mean(), last_losses.mean()
    elapsed = time.perf_counter() - start
    print(f"train/rollout log-prob mismatch on the first PPO step: max {max_mismatch:.1e} "
          f"{'without' if args.no_keep_mask else 'with'} keep_mask (plain log-probs, no mask: "
          f"{max_mismatch_unmasked:.1e})")

    failures = []
    if not loss_end < loss_start:
        failures.append(f"the PPO loss did not go down within batches ({loss_start:.4f} -> "
                        f"{loss_end:.4f})")
    if not (np.mean(last_losses < first_losses) >= 0.75):
        failures.append("the PPO loss went down in fewer than 75% of the batches")
    if not reward_end > reward_start + 0.3:
        failures.append(f"the reward did not go up by 0.3 ({reward_start:.3f} -> {reward_end:.3f})")
    if not max_mismatch < 1e-4:
        failures.append(f"trainer and rollout log-probs differ by {max_mismatch:.1e}")
    if failures:
        print("GRPO FAILED: " + "; ".join(failures))
        return 1
    print(f"GRPO OK in {elapsed:.0f} s: loss went down: {loss_start:+.4f} -> {loss_end:+.4f} "
          f"(mean over {len(history)} batches, before -> after {PPO_EPOCHS} PPO steps); reward "
          f"went up: {reward_start:.3f} -> {reward_end:.3f} (random policy: {1 / NUM_BUCKETS:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
