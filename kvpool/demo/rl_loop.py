"""A reinforcement-learning loop that learns, colocated on one kvpool budget
(``kvpool demo --scenario train``, ``examples/rl_loop.py``,
``benchmarks/train_colocate_bench.py``): rollouts through an elastic ``kvpool serve``
(OpenAI API), a GRPO update of the policy (:mod:`kvpool.demo.policy`) whose parameters,
gradients and optimizer state live in the pool as a trainer tenant
(:mod:`kvpool.client_lib.trainer`), the new weights published to the engine.

The task is verifiable: for a fixed set of prompts (random token ids), the reward of an
answer is the fraction of its tokens whose id is below ``target_span`` (a pattern the
sampled answers rarely show at first: about ``target_span / vocab`` of them). Each step
samples ``samples`` answers per prompt (temperature 1, one seed per answer, so a run is
deterministic), gives each answer the group-normalised advantage of GRPO and takes one
Adam step on ``-advantage * log p(answer)``.

One step's phases, each timed (:class:`StepRecord`): rollout; the switch to training
(the trainer's step memory granted: the daemon takes the idle engine's KV; a baseline
sleeps the engine first); the update (inside ``trainer.step``); the switch back and the
publish (the policy saved as a checkpoint, the engine told to serve it:
``POST /kvpool/weights``). How the engine switches is a :class:`Switch`: :class:`KvSwitch`
(kvpool: nothing to do, the KV goes and comes back on demand, the weights stay); the
benchmark adds the sleep/wake baselines.

In place (``Loop(..., in_place=True)``, when the policy's tensors fit the engine's layout:
:mod:`kvpool.engine_adapters.bundled.inplace_trainer`): the policy's parameters are the
engine's weights, a mutable weight set the trainer writes; each update is written into
its back buffer and published, and the engine told to read the new version
(``POST /kvpool/weights {"mutable": NONCE, "version": V}``): no checkpoint written, no
byte of weights copied. Otherwise (another dtype or layout; ``in_place_why`` says why)
the checkpoint path.
"""

from __future__ import annotations

import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import httpx
import torch

from kvpool.client_lib import Monitor
from kvpool.client_lib.trainer import Trainer
from kvpool.demo.policy import Policy
from kvpool.engine_adapters.bundled.inplace_trainer import InPlaceWeights, placement


@dataclass
class LoopConfig:
    """The task and the update; the defaults rise from ~0.1 to ~0.5 in 12 steps on the
    tiny model (lr 1e-2; measured 0.10 -> 0.60 with the policy sampling itself)."""

    steps: int = 12
    prompts: int = 4
    samples: int = 8  # answers per prompt (a GRPO group)
    prompt_len: int = 16
    max_tokens: int = 8
    target_span: int = 64  # reward: the fraction of answer tokens with id < this
    lr: float = 1e-2
    seed: int = 0
    vocab: int = 512
    greedy_check: bool = True  # after each publish, the engine's greedy tokens


@dataclass
class Back:
    """What a :class:`Switch` did after the update: seconds to give the engine its memory
    back, seconds to publish, bytes it copied (besides the checkpoint written)."""

    switch_s: float
    publish_s: float
    copied: int
    publish: dict[str, Any] = field(default_factory=dict)


class Switch(Protocol):
    """How a loop hands the memory from the engine to the trainer and back."""

    name: str

    def step_bytes(self, trainer: Trainer) -> int:
        """The trainer's step memory in this mode."""
        ...

    def to_train(self) -> int:
        """Before the step is granted; returns bytes copied."""
        ...

    def back(self, checkpoint: Path) -> Back:
        """After the step: the engine serving again, with ``checkpoint``'s weights."""
        ...


def publish(url: str, checkpoint: Path, token: str | None = None) -> dict[str, Any]:
    """``POST url/kvpool/weights``: the engine serves ``checkpoint`` from its next step;
    RuntimeError (one line) when it refuses."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    r = httpx.post(f"{url}/kvpool/weights", json={"checkpoint": str(checkpoint)},
                   headers=headers, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"publish refused ({r.status_code}): {r.text[:300]}")
    reply: dict[str, Any] = r.json()
    return reply


def publish_mutable(url: str, nonce: str, version: int | None = None,
                    token: str | None = None) -> dict[str, Any]:
    """``POST url/kvpool/weights`` in place: the engine reads ``version`` (None: the
    current one) of the trainer's mutable set ``nonce``; RuntimeError (one line) when it
    refuses."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    body: dict[str, Any] = {"mutable": nonce}
    if version is not None:
        body["version"] = version
    r = httpx.post(f"{url}/kvpool/weights", json=body, headers=headers, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"publish refused ({r.status_code}): {r.text[:300]}")
    reply: dict[str, Any] = r.json()
    return reply


def complete(url: str, model: str, prompt: list[int], max_tokens: int,
             seed: int | None) -> list[int]:
    """One answer's token ids: sampled at temperature 1 with ``seed``, or greedy (None)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "ignore_eos": True, "return_token_ids": True}
    body |= {"temperature": 1.0, "seed": seed} if seed is not None else {"temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"rollout request refused ({r.status_code}): {r.text[:300]}")
    ids: list[int] = r.json()["choices"][0]["token_ids"]
    return ids


class KvSwitch:
    """kvpool's switch: nothing to do. The step's grant makes the daemon take the idle
    engine's KV (its weights stay mapped), the step's end gives the memory back and the
    engine grows on demand; the publish loads the new set while the KV stays."""

    name = "kvpool"

    def __init__(self, url: str, step_bytes: Callable[[Trainer], int]) -> None:
        self.url = url
        self._step_bytes = step_bytes

    def step_bytes(self, trainer: Trainer) -> int:
        return self._step_bytes(trainer)

    def to_train(self) -> int:
        return 0

    def back(self, checkpoint: Path) -> Back:
        t0 = time.perf_counter()
        reply = publish(self.url, checkpoint)
        return Back(0.0, time.perf_counter() - t0, reply["bytes_copied"], reply)


@dataclass
class StepRecord:
    """One step of the loop (seconds, bytes, the reward, memory per tenant)."""

    step: int
    reward: float
    loss: float
    rollout_s: float
    to_train_s: float
    train_s: float
    to_rollout_s: float
    publish_s: float
    step_s: float
    checkpoint_bytes: int  # the policy's weights written as a checkpoint
    bytes_copied: int  # every copy this step: checkpoint, load, sleep/wake, optimizer state
    weights_copied: int  # of which copies of weights: checkpoint, load, wake (0 in place)
    held_train: dict[str, dict[str, int]]  # ps during the update: {tenant: {mapped, weights}}
    held_rollout: dict[str, dict[str, int]]  # ps after the rollout
    held_after: dict[str, dict[str, int]] = field(default_factory=dict)  # ps at the step's end
    greedy: list[list[int]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def held(monitor: Monitor) -> dict[str, dict[str, int]]:
    """Every tenant's pool bytes now: KV or state (``mapped``) and weight sets."""
    return {t.name: {"mapped": t.mapped, "weights": t.weights}
            for t in monitor.ps().tenants}


class Loop:
    """The loop over one engine (``url``, model served as ``model``), one trainer and one
    :class:`Switch`; :meth:`run` returns a record per step. Checkpoints go to ``out``
    (the newest two kept: the engine reloads the current one on a cold wake).
    ``in_place``: publish in place when the layouts match (see the module); the switch's
    ``back`` is then not called (kvpool's has nothing else to do). :meth:`close` at the
    end (the in-place set's writer lets go)."""

    def __init__(self, cfg: LoopConfig, url: str, model: str, source: Path,
                 trainer: Trainer, monitor: Monitor, switch: Switch, out: Path,
                 on_step: Callable[[StepRecord], None] | None = None,
                 in_place: bool = False) -> None:
        self.cfg, self.url, self.model = cfg, url, model
        self.source, self.trainer, self.monitor = source, trainer, monitor
        self.switch, self.out, self.on_step = switch, out, on_step
        torch.manual_seed(cfg.seed)
        policy = Policy.load(source)
        self.inplace: InPlaceWeights | None = None
        self.in_place_why = "not asked" if not in_place else ""
        self.version = 0  # the in-place set's version the engine reads
        if in_place:
            self._go_in_place(policy)
        self.policy = trainer.put_module(policy, params=self.inplace is None)
        self.opt = trainer.put_optimizer(torch.optim.Adam(self.policy.parameters(), lr=cfg.lr))
        rng = random.Random(cfg.seed)
        self.prompts = [[rng.randrange(8, cfg.vocab) for _ in range(cfg.prompt_len)]
                        for _ in range(cfg.prompts)]
        self.checkpoints: list[Path] = []

    def _go_in_place(self, policy: Policy) -> None:
        placed = placement(self.source, torch.float32, {n: policy.w(n) for n in policy.names})
        if isinstance(placed, str):
            self.in_place_why = placed
            return
        params = {n: policy.params[i] for i, n in enumerate(policy.names)}
        w = InPlaceWeights.create(self.trainer.tenant, placed, params)
        try:
            self.version = int(publish_mutable(self.url, w.nonce)["version"])
        except RuntimeError as e:  # the engine's layout differs: checkpoints, then
            w.close()
            self.in_place_why = str(e)
            return
        self.inplace = w

    def close(self) -> None:
        """The in-place set's writer lets go (the engine keeps the last version); the
        policy stays usable (copied to process memory). Idempotent."""
        if self.inplace is not None:
            self.inplace.close()
            self.inplace = None

    # ---- the phases ------------------------------------------------------------------
    def _complete(self, prompt: list[int], seed: int | None) -> list[int]:
        return complete(self.url, self.model, prompt, self.cfg.max_tokens, seed)

    def rollout(self, step: int) -> list[list[list[int]]]:
        """``samples`` answers per prompt, all requests at once (the engine batches)."""
        c = self.cfg
        jobs = [(p, c.seed * 1_000_003 + step * 1009 + i * c.samples + j)
                for i, p in enumerate(self.prompts) for j in range(c.samples)]
        with ThreadPoolExecutor(16) as pool:
            flat = list(pool.map(lambda job: self._complete(*job), jobs))
        return [flat[i * c.samples:(i + 1) * c.samples] for i in range(c.prompts)]

    def greedy(self) -> list[list[int]]:
        """The engine's greedy answer to every prompt."""
        return self.greedy_of(self.url, self.model, self.prompts, self.cfg.max_tokens)

    @staticmethod
    def greedy_of(url: str, model: str, prompts: list[list[int]],
                  max_tokens: int) -> list[list[int]]:
        """The greedy answers of the server at ``url`` (another engine: a check)."""
        return [complete(url, model, p, max_tokens, None) for p in prompts]

    def reward(self, answer: list[int]) -> float:
        return sum(t < self.cfg.target_span for t in answer) / max(len(answer), 1)

    def update(self, answers: list[list[list[int]]]) -> float:
        """One GRPO step over the rollout; returns the loss."""
        self.opt.zero_grad(set_to_none=False)
        total = 0.0
        for prompt, group in zip(self.prompts, answers):
            r = torch.tensor([self.reward(a) for a in group])
            adv = (r - r.mean()) / (r.std() + 1e-4)
            lp = self.policy.token_logprobs(prompt, group)
            loss = -(adv[:, None] * lp).mean() / len(self.prompts)
            loss.backward()  # type: ignore[no-untyped-call]
            total += float(loss.detach())
        if self.inplace is not None:  # written into the back buffer, published
            self.inplace.step(self.opt)
        else:
            self.opt.step()
        self.trainer.zero_grad()
        return total

    def save(self, step: int) -> tuple[Path, int]:
        path = self.out / f"step-{step:04d}"
        if path.exists():
            shutil.rmtree(path)
        n = self.policy.save(path, self.source)
        self.checkpoints.append(path)
        while len(self.checkpoints) > 2:
            shutil.rmtree(self.checkpoints.pop(0), ignore_errors=True)
        return path, n

    # ---- one step, N steps -------------------------------------------------------------
    def step(self, k: int) -> StepRecord:
        t0 = time.perf_counter()
        answers = self.rollout(k)
        t1 = time.perf_counter()
        reward = sum(self.reward(a) for g in answers for a in g) / sum(map(len, answers))
        rolled = held(self.monitor)
        t1b = time.perf_counter()  # (the ps snapshots are not counted in the step)
        offloads = self.trainer.offloads
        copied = self.switch.to_train()
        with self.trainer.step(self.switch.step_bytes(self.trainer)):
            t2 = time.perf_counter()
            during = held(self.monitor)
            t2b = time.perf_counter()
            loss = self.update(answers)
            t3 = time.perf_counter()
        t4 = time.perf_counter()
        # the optimizer state the daemon took back while the engine grew (offloaded to
        # process memory) came back for the step: two copies of it
        copied += 2 * (self.trainer.offloads - offloads) * self.trainer.optim.footprint
        if self.inplace is not None:  # the engine reads the new version: a remap
            reply = publish_mutable(self.url, self.inplace.nonce, self.inplace.version)
            self.version = int(reply["version"])
            written, back = 0, Back(0.0, 0.0, 0, reply)
        else:
            _, written = self.save(k)
            back = self.switch.back(self.checkpoints[-1])
        t5 = time.perf_counter()
        publish_s = t5 - t4 - back.switch_s
        rec = StepRecord(
            step=k, reward=reward, loss=loss, rollout_s=t1 - t0, to_train_s=t2 - t1b,
            train_s=t3 - t2b, to_rollout_s=(t4 - t3) + back.switch_s, publish_s=publish_s,
            step_s=(t5 - t0) - (t2b - t2) - (t1b - t1), checkpoint_bytes=written,
            bytes_copied=written + copied + back.copied,
            weights_copied=written + back.copied, held_train=during,
            held_rollout=rolled, held_after=held(self.monitor))
        if self.cfg.greedy_check:
            rec.greedy = self.greedy()
        return rec

    def run(self) -> list[StepRecord]:
        records = []
        for k in range(self.cfg.steps):
            rec = self.step(k)
            records.append(rec)
            if self.on_step is not None:
                self.on_step(rec)
        return records
