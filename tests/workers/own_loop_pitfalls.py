"""mpiexec worker: what a user's own loop does after ``apply_spatial`` besides the guide's snippet.

Usage: ``mpiexec -n 2 python tests/workers/own_loop_pitfalls.py`` (a 1x2 grid, float64). Each
check compares the tiled model with the same model in one process (``copy.deepcopy`` before
``apply_spatial``) and prints one JSON line on rank 0:

* ``other_size``: images of another size than ``apply_spatial(image_size=...)``, cut with
  ``tile_of`` (which sets the size): the largest relative error (they ran for the old size);
* ``wrong_tile``: a tile cut for another size fed directly: the one-line refusal;
* ``unfrozen``: a layer frozen at ``apply_spatial`` and unfrozen before training (fine-tuning),
  three SGD steps: the largest relative error of its weight (it trained on its tile's share);
* ``student``: a deep copy of the tiled model trained one SGD step (its parameters are the
  copy's: they trained on their tiles' shares, 0.2 relative): the largest relative error;
* ``autograd_grad``: ``torch.autograd.grad`` of the tile parameters: the refusal, and whether
  ``.grad`` kept its value (the tile sum was added to it);
* ``deepcopy``: an EMA-style ``copy.deepcopy`` of the tiled model: its output's relative error
  against the model's (it failed with "cannot pickle 'ProcessGroup'");
* ``replaced``: a convolution put into the model after ``apply_spatial``: the refusal (it ran
  on the tile as a plain layer, 0.47 relative in training);
* ``user_hook``: a gradient hook of the user's (``p.register_hook(lambda g: 3 * g)``) added
  after ``apply_spatial``, with ``zero_grad(set_to_none=False)`` and two backwards per step:
  the largest relative error of the weights after three steps (0.44 in a gradient: the rule
  took the hook's input for what the backward added to ``.grad``);
* ``assigned``: weights loaded after ``apply_spatial`` by ``load_state_dict(sd, assign=True)``,
  the model run through its methods (``head(features(x))``)
  (new parameter objects), three steps: the largest relative error (0.54: the rule kept
  hooking the old objects);
* ``odd_pad``: a U-Net step that pads only where the shapes differ
  (``if y.shape != skip.shape``), at a size where the image pads and the probe does not:
  the refusal at ``apply_spatial`` (the tiles skipped the pad: 0.15 off, silently);
* ``mean_sizes``: ``hyfi.tiled_mean`` of dense outputs of two image sizes (a multi-scale
  loss), each given its size: the largest relative error against one process;
  ``mean_default``: the first without ``size=`` (it took the last size set: 1.4 % off):
  the refusal;
* ``ddp``: the tiled model wrapped in ``DistributedDataParallel`` (its reducer and the
  tiles' sum do not compose: 1.6e-2 off on 1x2 with 2 replicas): the refusal.
* ``penalty``: a gradient penalty (``torch.autograd.grad(..., create_graph=True)``, then a
  backward of the gradient's norm): autograd differentiated the backwards as if no halo or
  sum had been exchanged (parameters' gradients 0.18-0.56 off on 1x2): the refusal.
"""

from __future__ import annotations

import copy
import json

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.c2 = nn.Conv2d(6, 6, 3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(6, 3)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.c2(torch.relu(self.bn(self.c1(x)))))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(x), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / (b.abs().max() + 1e-300))


class ShapePad(nn.Module):
    """A U-Net step: pool, transposed convolution (with bias), pad to the skip if needed."""

    def __init__(self, rule: str) -> None:
        super().__init__()
        self.rule = rule
        self.enc, self.pool = nn.Conv2d(3, 2, 3, padding=1), nn.MaxPool2d(2)
        self.up = nn.ConvTranspose2d(2, 2, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.enc(x)
        y = self.up(self.pool(skip))
        dh, dw = skip.shape[-2] - y.shape[-2], skip.shape[-1] - y.shape[-1]
        if dh or dw:
            y = nn.functional.pad(y, (0, dw, 0, dh))
        return torch.cat([skip, y], 1)


def _train(
    models: tuple[nn.Module, nn.Module],
    ctx: object,
    steps: int,
    *,
    halves: int,
    methods: bool = False,
) -> float:
    """``steps`` SGD steps of the tiled and the one-process model, each of ``halves``
    backwards of the loss over ``halves`` (``.grad`` zeroed, not freed); ``methods``: the
    model run as ``head(features(x))`` (timm's way), not called; the largest relative error
    of any parameter after them."""
    import hyfi_imaging as hyfi

    gen = torch.Generator().manual_seed(11)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    for _ in range(steps):
        x, y = torch.randn(2, 3, 32, 24, generator=gen), torch.tensor([1, 2])
        inputs = (hyfi.tile_of(x, ctx, (32, 24)), x)  # type: ignore[arg-type]
        for m, opt, inp in zip(models, opts, inputs, strict=True):
            opt.zero_grad(set_to_none=False)
            for _ in range(halves):
                out = m.head(m.features(inp)) if methods else m(inp)  # type: ignore[operator]
                (nn.functional.cross_entropy(out, y) / halves).backward()
            opt.step()
    pairs = zip(models[0].parameters(), models[1].parameters(), strict=True)
    return max(_rel(p.detach(), q.detach()) for p, q in pairs)


def main() -> int:
    import hyfi_imaging as hyfi
    from hyfi_imaging.errors import HyfiError
    from hyfi_imaging.parallel.launch import shutdown

    torch.set_default_dtype(torch.float64)
    pc = hyfi.init_parallel(hyfi.Layout(sp=(1, 2)))
    gen = torch.Generator().manual_seed(3)
    found: dict[str, object] = {}

    torch.manual_seed(0)
    model = Net()
    model.c1.weight.requires_grad_(False)  # frozen when apply_spatial runs
    ref = copy.deepcopy(model)
    ctx = hyfi.apply_spatial(model, pc, image_size=(32, 24))
    model.eval(), ref.eval()
    with torch.no_grad():
        errors = []
        for hw in ((31, 23), (40, 32), (32, 24)):
            x = torch.randn(2, 3, *hw, generator=gen)
            errors.append(_rel(model(hyfi.tile_of(x, ctx, hw)), ref(x)))
        found["other_size"] = max(errors)
        try:
            model(torch.randn(2, 3, 32, 16, generator=gen))  # a tile of 32x32 images, not 32x24
            found["wrong_tile"] = "ran"
        except HyfiError as err:
            found["wrong_tile"] = str(err)
    model.train(), ref.train()
    model.c1.weight.requires_grad_(True), ref.c1.weight.requires_grad_(True)  # unfrozen
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    x, y = torch.randn(2, 3, 32, 24, generator=gen), torch.tensor([0, 2])
    for _ in range(3):
        for m, opt, inp in ((model, opts[0], hyfi.tile_of(x, ctx, (32, 24))), (ref, opts[1], x)):
            opt.zero_grad()
            nn.functional.cross_entropy(m(inp), y).backward()
            opt.step()
    found["unfrozen"] = _rel(model.c1.weight.detach(), ref.c1.weight.detach())
    students = copy.deepcopy(model), copy.deepcopy(ref)  # copies that train (a student)
    for m, inp in zip(students, (hyfi.tile_of(x, ctx, (32, 24)), x), strict=True):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        nn.functional.cross_entropy(m(inp), y).backward()
        opt.step()
    found["student"] = _rel(students[0].c1.weight.detach(), students[1].c1.weight.detach())
    before = model.c1.weight.grad.clone()
    try:
        loss = nn.functional.cross_entropy(model(hyfi.tile_of(x, ctx, (32, 24))), y)
        torch.autograd.grad(loss, [model.c1.weight])
        found["autograd_grad"] = "ran"
    except HyfiError as err:
        found["autograd_grad"] = str(err)
    found["grad_kept"] = bool(torch.equal(before, model.c1.weight.grad))
    model.eval()
    ema = copy.deepcopy(model)
    with torch.no_grad():
        tile = hyfi.tile_of(x, ctx, (32, 24))
        found["deepcopy"] = _rel(ema(tile), model(tile))
    model.c2 = nn.Conv2d(6, 6, 3, stride=2, padding=1)  # replaced after apply_spatial
    try:
        model(hyfi.tile_of(x, ctx, (32, 24)))
        found["replaced"] = "ran"
    except HyfiError as err:
        found["replaced"] = str(err)
    torch.manual_seed(0)
    hooked = Net(), Net()
    hooked[1].load_state_dict(hooked[0].state_dict())
    hook_ctx = hyfi.apply_spatial(hooked[0], pc, image_size=(32, 24))
    for m in hooked:
        m.c1.weight.register_hook(lambda g: 3.0 * g)  # the user's own, after apply_spatial
    found["user_hook"] = _train(hooked, hook_ctx, 3, halves=2)
    assigned = Net(), Net()
    assign_ctx = hyfi.apply_spatial(assigned[0], pc, image_size=(32, 24))
    torch.manual_seed(5)
    weights = Net().state_dict()
    for m in assigned:
        m.load_state_dict(copy.deepcopy(weights), assign=True)
    found["assigned"] = _train(assigned, assign_ctx, 3, halves=1, methods=True)
    try:
        hyfi.apply_spatial(ShapePad("odd"), pc, image_size=(33, 24))
        found["odd_pad"] = "ran"
    except HyfiError as err:
        found["odd_pad"] = str(err)
    dense, dense_ref = ShapePad("odd"), ShapePad("odd")
    dense_ref.load_state_dict(dense.state_dict())
    dense_ctx = hyfi.apply_spatial(dense, pc, image_size=(32, 24))
    big, small = torch.randn(2, 3, 32, 24, generator=gen), torch.randn(2, 3, 16, 12, generator=gen)
    maps = [dense(hyfi.tile_of(x, dense_ctx, x.shape[-2:])) for x in (big, small)]
    means = [
        hyfi.tiled_mean(m, dense_ctx, size)
        for m, size in zip(maps, ((32, 24), (16, 12)), strict=True)
    ]
    found["mean_sizes"] = max(
        _rel(got, dense_ref(x).mean()) for got, x in zip(means, (big, small), strict=True)
    )
    try:
        hyfi.tiled_mean(maps[0], dense_ctx)
        found["mean_default"] = "ran"
    except HyfiError as err:
        found["mean_default"] = str(err)
    ddp = torch.nn.parallel.DistributedDataParallel(dense)
    try:
        ddp(hyfi.tile_of(big, dense_ctx, (32, 24)))
        found["ddp"] = "ran"
    except HyfiError as err:
        found["ddp"] = str(err)
    # A gradient penalty: the input gradient with create_graph=True, its norm backward.
    image = hyfi.tile_of(big, dense_ctx, (32, 24)).requires_grad_(True)
    try:
        (g,) = torch.autograd.grad(dense(image).sum(), image, create_graph=True)
        (g * g).sum().backward()
        found["penalty"] = "ran"
    except HyfiError as err:
        found["penalty"] = str(err)
    if pc.rank == 0:
        print(json.dumps(found))
    shutdown()
    return 0


if __name__ == "__main__":
    from hyfi_imaging.parallel.launch import exit_now

    exit_now(main())  # every rank ends alike (a rank that ends first got the job killed)
