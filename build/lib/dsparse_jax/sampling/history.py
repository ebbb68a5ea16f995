"""The history drafter's bank: earlier completions of each training prompt, across RL steps.

On the device: tokens int32 [C, H, S] (C prompts, the H newest rollouts of each, rows in
the rollout layout: prompt + completion, S its buffer width) and lengths int32 [C, H] (0: empty). On the
host: which prompt owns which slot (a stable 64-bit hash of its tokens), a ring pointer
per slot and a last-use stamp (a new prompt evicts the least recently used one). The
sampler reads `rows(slots)` ([P, H, S], one device gather); `add` writes a step's rollouts
with one device scatter. `state()` / `load()` put it in the RL checkpoint, so a resumed
run drafts from the same bank.
"""

from __future__ import annotations

import hashlib

import jax.numpy as jnp
import numpy as np

from dsparse_jax.sampling.speculative import History


def prompt_key(tokens) -> int:
    """A stable 64-bit id of a prompt's tokens (the same in every process and run)."""
    digest = hashlib.blake2b(np.asarray(tokens, np.int32).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class HistoryBank:
    def __init__(self, num_prompts: int, per_prompt: int, width: int):
        if num_prompts < 1 or per_prompt < 1:
            raise ValueError("rl.history_prompts and rl.history_per_prompt must be >= 1")
        self.num_prompts, self.per_prompt = num_prompts, per_prompt
        self.keys = np.zeros(num_prompts, np.int64)
        self.owned = np.zeros(num_prompts, bool)
        self.next = np.zeros(num_prompts, np.int64)  # ring position of the next write
        self.stamp = np.zeros(num_prompts, np.int64)  # last use (LRU eviction)
        self.clock = 0
        self.tokens = jnp.zeros((num_prompts, per_prompt, width), jnp.int32)
        self.lengths = jnp.zeros((num_prompts, per_prompt), jnp.int32)

    def slots(self, keys) -> np.ndarray:
        """The slot of each prompt key, claimed (least recently used first) when new."""
        self.clock += 1
        index = {int(k): i for i, k in enumerate(self.keys) if self.owned[i]}
        out = np.zeros(len(keys), np.int64)
        for j, key in enumerate(keys):
            slot = index.get(int(key))
            if slot is None:
                free = np.flatnonzero(~self.owned)
                slot = int(free[0]) if len(free) else int(np.argmin(self.stamp))
                self.keys[slot], self.owned[slot], self.next[slot] = key, True, 0
                self.lengths = self.lengths.at[slot].set(0)
                index[int(key)] = slot
            self.stamp[slot] = self.clock
            out[j] = slot
        return out

    def rows(self, slots, width: int) -> History:
        """Bank rows of these slots: History([P, H, width], [P, H])."""
        if self.tokens.shape[2] != width:
            raise ValueError(f"history rows are {self.tokens.shape[2]} wide, rollouts {width}")
        idx = jnp.asarray(slots, jnp.int32)
        return History(self.tokens[idx], self.lengths[idx])

    def add(self, slots, tokens_BxS, lengths_B, samples_per_prompt: int) -> None:
        """Stores each prompt's samples_per_prompt rows (contiguous in the batch), the
        newest replacing the oldest once a slot holds per_prompt rows."""
        m = samples_per_prompt
        slot_B = np.repeat(np.asarray(slots), m)
        ring_B = np.repeat(self.next[slots], m) + np.tile(np.arange(m), len(slots))
        ring_B = ring_B % self.per_prompt
        keep = np.ones(len(slot_B), bool)
        if m > self.per_prompt:  # only the last per_prompt rows of a group survive anyway
            keep = np.tile(np.arange(m) >= m - self.per_prompt, len(slots))
        s_i, r_i = jnp.asarray(slot_B[keep]), jnp.asarray(ring_B[keep])
        self.tokens = self.tokens.at[s_i, r_i].set(jnp.asarray(tokens_BxS)[np.flatnonzero(keep)])
        self.lengths = self.lengths.at[s_i, r_i].set(jnp.asarray(lengths_B)[np.flatnonzero(keep)])
        self.next[slots] = (self.next[slots] + m) % self.per_prompt

    def state(self) -> dict:
        """Everything, as numpy arrays (for the checkpoint)."""
        return {
            "tokens": np.asarray(self.tokens),
            "lengths": np.asarray(self.lengths),
            "keys": self.keys.copy(),
            "owned": self.owned.copy(),
            "next": self.next.copy(),
            "stamp": self.stamp.copy(),
            "clock": np.asarray(self.clock, np.int64),
        }

    def load(self, state: dict) -> None:
        self.tokens = jnp.asarray(state["tokens"])
        self.lengths = jnp.asarray(state["lengths"])
        self.keys = np.asarray(state["keys"], np.int64).copy()
        self.owned = np.asarray(state["owned"], bool).copy()
        self.next = np.asarray(state["next"], np.int64).copy()
        self.stamp = np.asarray(state["stamp"], np.int64).copy()
        self.clock = int(state["clock"])
