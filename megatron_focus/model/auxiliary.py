"""Losses a layer adds to the language-modelling loss without joining it: attached to an
activation, each gets its gradient in the main loss's backward (Megatron-Core attaches its MoE
auxiliary losses and its DSA indexer loss so), also under activation recomputation, where a
layer's forward runs again inside the backward. The trainer sets the gradient they receive to
the main loss's own scaling (`AuxiliaryLoss.scale`).
"""

import torch


class AuxiliaryLoss(torch.autograd.Function):
    """`apply(activation, loss)`: the activation unchanged; in backward the loss receives the
    gradient `scale` (the main loss's: 1 / micro-batches, as DeepSpeed divides it, times the
    context-parallel size, as the trainer's language-modelling loss is scaled, times fp16's loss
    scale)."""

    scale = 1.0  # set by the trainer before each micro-batch's backward

    @staticmethod
    def forward(ctx, activation: torch.Tensor, loss: torch.Tensor):
        ctx.save_for_backward(loss)
        return activation

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, AuxiliaryLoss.scale)
