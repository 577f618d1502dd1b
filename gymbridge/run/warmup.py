"""Format warm-up: a few supervised steps that teach a random model the answer *format*, not the answers.

A random-weight model almost never emits an environment's answer format (a colour word,
a ``look`` tool call), so every GRPO group has zero reward variance and nothing is learned.
:func:`format_warmup` fixes the format before GRPO starts: it trains the policy with
teacher-forced cross-entropy on ``(Responses input items, target text)`` examples that an
environment supplies (``format_examples(row, rng)`` in its data module, e.g.
:func:`environments.color_pick.data.format_examples`).

The honesty rule, which the environment's examples must keep and the launcher's controls
check (a blanked image stays at chance): **targets never depend on the row's answer**. They
span the answer vocabulary at random, so after the warm-up every answer is about equally
likely whatever the image shows, and the image-to-answer mapping can only come from the
environment's reward.

Invariants: prompts are rendered exactly as the generator renders them (the generator's own
:class:`~gymbridge.generation.chat.ChatCodec` and media processing), so the format learned
is the format sampled; the loss is taken under the generator's sampling mask (media
placeholder ids suppressed) at temperature 1; the warm-up has its own AdamW, so the GRPO
optimizer's state starts fresh; it changes the weights in place and nothing else.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field

from gymbridge.config import StrictModel

if TYPE_CHECKING:
    from gymbridge.generation.hf import HFGenerator

logger = logging.getLogger(__name__)

__all__ = ["FormatExample", "WarmupConfig", "WarmupResult", "format_warmup"]

FormatExample = tuple[list[dict[str, Any]], str]
"""``(Responses input items, target text)``: the target is what the model should answer next."""


class WarmupConfig(StrictModel):
    """The launcher's ``warmup:`` section (``steps: 0`` turns it off)."""

    steps: int = Field(0, ge=0)
    """Supervised steps (each: ``rows_per_step`` rows' examples, one optimizer step)."""
    lr: float = Field(1e-2, gt=0)
    lr_schedule: Literal["constant", "linear"] = "constant"
    """``linear``: the lr falls from ``lr`` to 0 over the steps, so the last steps' randomly drawn
    targets cannot leave the policy leaning to one answer (``constant`` ends wherever they pushed)."""
    rows_per_step: int = Field(4, ge=1)
    seed: int = 0
    """Seed of the warm-up rows and of the random target choice (never the training rows)."""


@dataclass(frozen=True)
class WarmupResult:
    steps: int
    """Optimizer steps taken (a step whose rows left no example is not taken)."""
    examples: int
    first_loss: float
    last_loss: float
    elapsed_s: float
    skipped: int = 0
    """Examples left out because their target is the run's forced first call (never sampled)."""


def _example_tensors(
    generator: HFGenerator, items: list[dict[str, Any]], tools: Any, target: str
) -> tuple[dict[str, Any], int, list[int]]:
    from gymbridge.generation.chat import responses_to_messages, responses_tools_to_chat
    from gymbridge.trajectory.refresh import ConversationHistory, build_generation_input

    messages = responses_to_messages(items)
    rendered = generator.codec.render(messages, responses_tools_to_chat(tools))
    history = ConversationHistory()
    history.append(rendered.prompt_token_ids, rendered.media)
    inp = build_generation_input(history)
    target_ids = [int(t) for t in generator.tokenizer(target, add_special_tokens=False)["input_ids"]]
    target_ids.append(generator.codec.end_of_turn_id)
    full = torch.tensor([list(inp.prompt_token_ids) + target_ids], dtype=torch.long)
    kwargs = generator.model_inputs(full, torch.ones_like(full), generator.media_kwargs([inp]))
    return kwargs, len(inp.prompt_token_ids), target_ids


def format_warmup(
    policy: Any,
    generator: HFGenerator,
    rows: Sequence[Mapping[str, Any]],
    examples: Callable[[Mapping[str, Any], random.Random], list[FormatExample]],
    config: WarmupConfig,
    *,
    skip_target: str | None = None,
) -> WarmupResult:
    """Train ``policy`` (the generator's model or the trainer's copy of it) on ``examples`` of ``rows``.

    Row ``s * rows_per_step + j`` (cycled) feeds step ``s``; each example's loss is the mean
    negative log-likelihood of its target tokens (plus end of turn); a step averages its
    examples' losses. Examples whose target is ``skip_target`` are left out and counted
    (:attr:`WarmupResult.skipped`); a step left with none is not taken.
    """
    from gymbridge.generation.hf import suppress_logits

    started = time.perf_counter()
    if config.steps == 0 or not rows:
        return WarmupResult(0, 0, 0.0, 0.0, 0.0)
    rng = random.Random(f"gymbridge/warmup/{config.seed}")
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=config.lr)
    if config.lr_schedule == "linear":  # step s (0-based) runs at lr * (1 - s / steps): the last near 0
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / config.steps)
    suppressed = generator.suppressed_token_ids
    losses: list[float] = []
    n_examples = skipped = 0
    for step in range(config.steps):
        batch: list[tuple[dict[str, Any], int, list[int]]] = []
        for j in range(config.rows_per_step):
            row = rows[(step * config.rows_per_step + j) % len(rows)]
            rcp = row["responses_create_params"]
            for items, target in examples(row, rng):
                if target == skip_target:
                    skipped += 1
                    continue
                batch.append(_example_tensors(generator, items, rcp.get("tools"), target))
        if not batch:  # every example of these rows was left out
            continue
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for kwargs, prompt_len, target_ids in batch:
            logits = policy(**kwargs).logits[0]  # [L, V]
            logp = torch.log_softmax(suppress_logits(logits.float(), suppressed), dim=-1)
            picked = logp[prompt_len - 1 : prompt_len - 1 + len(target_ids)]
            idx = torch.tensor(target_ids, device=picked.device)[:, None]
            loss = -picked.gather(-1, idx).mean() / len(batch)
            loss.backward()  # type: ignore[no-untyped-call]
            total += float(loss.detach())
        optimizer.step()
        if config.lr_schedule == "linear":
            schedule.step()
        losses.append(total)
        n_examples += len(batch)
        logger.debug("warm-up step %d: loss %.4f", step + 1, total)
    optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - started
    if not losses:
        return WarmupResult(0, 0, 0.0, 0.0, elapsed, skipped)
    return WarmupResult(len(losses), n_examples, losses[0], losses[-1], elapsed, skipped)


def warmup_for_env(
    spec: Any,
    params: Mapping[str, Any],
    policy: Any,
    generator: HFGenerator,
    config: WarmupConfig,
    *,
    forced_first_call: str | None = None,
) -> WarmupResult | None:
    """:func:`format_warmup` on rows of the example environment ``spec`` (its ``format_examples``).

    ``None`` when ``config.steps == 0``; :class:`~gymbridge.errors.ConfigError` when the
    environment has no ``format_examples``. The rows are generated with the warm-up's own
    seed, so they are not the rows the run trains on.

    ``forced_first_call`` (the launcher's ``force_first_call``): examples whose target is
    that text are left out (counted in :attr:`WarmupResult.skipped`). The run never samples
    its first call, so all the warm-up's steps go to the format that is sampled
    (docs/environments.md, the multi-turn variant).
    """
    from gymbridge.errors import ConfigError

    if config.steps == 0:
        return None
    examples = getattr(spec.data_module(), "format_examples", None)
    if examples is None:
        raise ConfigError(
            [f"warmup.steps={config.steps}: {spec.name!r} has no format_examples; set warmup.steps=0"]
        )
    rows = list(spec.generate(config.rows_per_step * 4, 1_000_003 + config.seed, **params))
    return format_warmup(policy, generator, rows, examples, config, skip_target=forced_first_call)
