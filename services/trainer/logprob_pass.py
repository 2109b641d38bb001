"""The pass from token ids to log p(target): the decoder, then the output head and log-softmax over
chunks of real positions (the B x T x V logits never exist at once)."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from temper.services.lora.deterministic import active as deterministic_active
from temper.services.lora.model import LoraModel
from temper.services.trainer.target_logprobs import head_target_logprobs, target_logprobs
from temper.services.trainer.vision import PassImages


def target_logprobs_pass(lora: LoraModel, ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor, routing,
                         chunk_tokens: int, checkpoint_decoder: bool = False, images: PassImages | None = None) -> torch.Tensor:
    """log p(target) at every position and target column, temperature 1, full vocabulary, (B, T, K).

    ``routing``: [(adapter key, row indices)]. The lm_head + log-softmax runs over chunks of real
    (unpadded) positions, recomputed in the backward pass, so the B x T x V logits tensor never
    exists at once. ``checkpoint_decoder`` recomputes the decoder layers in the backward pass too
    (when ``lora.checkpoint_decoder_layers()`` wrapped them). ``images``: a vision-language model's
    explicit positions and tower outputs (``vision.ImageFeatures.pass_inputs``).
    """
    model = lora.model
    if getattr(model.config, "final_logit_softcapping", None):
        # logits post-processed past the head (soft-capping): the plain full-logits path
        with lora.route(routing), lora.checkpointing_enabled(checkpoint_decoder):
            logits = model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits.float()
        return logits.log_softmax(-1).gather(-1, targets) * mask[..., None]
    with lora.route(routing), lora.checkpointing_enabled(checkpoint_decoder):
        if images is not None:  # the multimodal wrapper: image features merged in, positions as given
            hidden = model.model(input_ids=ids, attention_mask=mask.long(), position_ids=images.position_ids,
                                 mm_encoder_outputs=images.encoder_outputs, use_cache=False).last_hidden_state
        else:
            hidden = model.get_decoder()(input_ids=ids, attention_mask=mask.long(), use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    flat_hidden, flat_targets = hidden[mask], targets[mask]
    # the adapter of every real token, for the head's routing
    head_adapters = getattr(head, "adapters", {})
    if any(key in head_adapters for key, _ in routing):
        token_rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)[mask]
        token_groups = [(key, torch.isin(token_rows, rows).nonzero().squeeze(-1)) for key, rows in routing]
    else:  # no adapter on the head: no per-chunk routing (and none of its device syncs)
        token_groups = []
    sparse = torch.is_grad_enabled() and flat_hidden.requires_grad and _sparse_head_backward(head, [k for k, _ in token_groups])
    pieces = []
    for start in range(0, flat_hidden.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        local = [(k, t[(t >= start) & (t < stop)] - start) for k, t in token_groups]
        hidden_chunk, targets_chunk = flat_hidden[start:stop], flat_targets[start:stop]
        if sparse:
            pieces.append(head_target_logprobs(hidden_chunk, targets_chunk, functools.partial(_head_logits, lora, head, local)))
        elif torch.is_grad_enabled():
            pieces.append(checkpoint(_head_logprobs, lora, head, hidden_chunk, targets_chunk, local, use_reentrant=False))
        else:
            pieces.append(_head_logprobs(lora, head, hidden_chunk, targets_chunk, local))
    out = torch.zeros(targets.shape, dtype=torch.float32, device=ids.device)
    return out.masked_scatter(mask[..., None].expand_as(targets), torch.cat(pieces)) if pieces else out


def _sparse_head_backward(head, routed: list[str]) -> bool:
    """Whether the head's backward may run on the rows with a gradient only: not in deterministic mode
    (a smaller recomputation changes the last bits, and its passes take gradients with
    ``torch.autograd.grad``), not with a trained base head or adapter dropout on the head (a
    recomputation over fewer rows would draw other dropout masks)."""
    adapters = getattr(head, "adapters", {})
    return (not deterministic_active() and not any(p.requires_grad for p in head.parameters())
            and not any(getattr(adapters.get(k), "dropout", 0) for k in routed))


def _head_logits(lora: LoraModel, head, routing, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Float logits of ``hidden``: the chunk's rows ``rows`` (ascending; None: all), routed as they are."""
    if rows is not None:
        routing = [(k, torch.searchsorted(rows, t[torch.isin(t, rows)])) for k, t in routing]
    with lora.route([(k, t) for k, t in routing if t.numel()]):
        return head(hidden).float()


def _head_logprobs(lora: LoraModel, head, hidden: torch.Tensor, targets: torch.Tensor, routing) -> torch.Tensor:
    # Routing is set inside so the backward-pass recomputation routes the same way.
    return target_logprobs(_head_logits(lora, head, routing, hidden), targets)
