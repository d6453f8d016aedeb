"""The actor's AdamW: the fused kernel, whose values must not depend on how the parameters are
grouped or sharded (a resharded resume relies on it), with Megatron's weight-decay groups."""

from __future__ import annotations

import torch

from mileage.training.optimizer import OptimConfig, build_optimizer


def _steps(pieces: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> torch.Tensor:
    """Three fused AdamW steps over `pieces`, each with its own gradient per step."""
    params = [torch.nn.Parameter(p.clone()) for p in pieces]
    model = torch.nn.Module()
    for i, p in enumerate(params):
        model.register_parameter(f"w{i}", p)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.1))
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in params])


def test_the_actor_optimizer_is_fused_adamw_with_decay_on_matrices_only() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.05))
    assert isinstance(optimizer, torch.optim.AdamW)
    assert all(group["fused"] for group in optimizer.param_groups)
    decayed = {group["weight_decay"]: len(group["params"]) for group in optimizer.param_groups}
    assert decayed == {0.05: 1, 0.0: 3}  # the weight matrix; both biases and the norm weight


def test_fused_steps_do_not_depend_on_how_the_parameter_is_cut() -> None:
    gen = torch.Generator().manual_seed(0)
    n = 10_007  # a prime: no cut lands on a vector boundary of every width
    weights = torch.randn(1, n, generator=gen)
    grads = [torch.randn(1, n, generator=gen) * 1e-3 for _ in range(3)]
    whole = _steps([weights], [[g] for g in grads])
    for cut in (1, 7, 5003, n - 1):  # one rank's shard ends at `cut`, the other's starts there
        pieces = [weights[:, :cut], weights[:, cut:]]
        cut_grads = [[g[:, :cut], g[:, cut:]] for g in grads]
        assert torch.equal(_steps(pieces, cut_grads), whole), cut
