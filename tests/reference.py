"""Independent references for the optimizer tests: torch.optim in float64."""
import torch


def reference_adam(p0, grads, *, adamw, lr, wd, betas, eps, grad_scale, dtype=torch.float64):
    """torch.optim.Adam/AdamW on the CPU (in float64 unless told), fed the
    same (scaled) gradients; returns (param, exp_avg, exp_avg_sq)."""
    p = torch.nn.Parameter(p0.detach().cpu().to(dtype))
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([p], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    for g in grads:
        p.grad = g.detach().cpu().to(dtype) * grad_scale
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]
