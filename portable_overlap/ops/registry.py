"""The op table: one :class:`OpSpec` per public op, and the one place that turns a spec into a
``torch.library`` op (schema, eager kernel, fake implementation, autograd) and into the
eager/compile split of the op's Python function.

A spec names the op, its schema (the tensors and options the op takes, one ``int handle``
argument that finds the context, see ``ops.context.get_context``), the pattern's context class
and transports, how to compute the result's shape without running anything (``fake``) and where
the op's Triton kernels are listed for the compile matrix. The package's public namespace, the
kernel compile list (``kernel_registry``) and the registry tests read :data:`SPECS`.

Calling a spec (what every public op function does) runs the context directly in eager mode,
which skips the dispatcher (a few microseconds per call, and options such as ``out=`` that a
functional op cannot take); under ``torch.compile``, or when autograd must see the op, it calls
the ``torch.ops.portable_overlap`` op instead, which the compiler treats as one opaque node.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

import torch

from .context import ContextBase, get_context, refuse_grad_as_call

NAMESPACE = "portable_overlap"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")

#: every defined op by name, in definition order
SPECS: dict = {}

_ARG = re.compile(r"(?:^|,)\s*[\w?\[\]]+\s+(\w+)")


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One public op.

    ``schema``: the torch.library argument list and result, e.g.
    ``"(Tensor a, Tensor b, int handle, Tensor? bias=None) -> Tensor"``; exactly one argument is
    ``int handle``. ``fake(ctx, *args)`` returns an empty tensor of the result's shape, dtype and
    device from the op's arguments without the handle (``ctx`` is the context, for its world
    size and rank). ``eager(ctx, *args, **options)`` runs the op; by default it calls the
    context (``ctx(*args, **options)``). ``backward`` / ``setup_context`` are torch.library's
    autograd pair, for ops with a gradient. ``context``: the pattern's context class (the
    handle must name one). ``transports``: the values of its ``transport=`` argument (the
    pattern contexts also take ``"auto"``, which picks one of them: ``ops/planner.py``).
    ``compile_specs``: the modules (dotted names) whose ``specs()`` list the kernels the op
    launches, for the compile matrix (``kernel_registry``). ``copies``: the results (by
    position) that are the context's own buffers in the eager call: the torch op returns copies
    of them, as a functional op's results must not alias each other or an input (torch checks
    that under ``torch.compile``), and the context's next call overwrites them."""

    name: str
    schema: str
    fake: Callable
    context: type
    transports: tuple = ()
    eager: Optional[Callable] = None
    backward: Optional[Callable] = None
    setup_context: Optional[Callable] = None
    compile_specs: tuple = ()
    copies: tuple = ()

    @property
    def arg_names(self) -> tuple:
        args = self.schema[self.schema.index("(") + 1: self.schema.rindex(")")]
        return tuple(_ARG.findall(args))

    @property
    def handle_index(self) -> int:
        return self.arg_names.index("handle")

    @property
    def op(self):
        """The op's ``torch.ops`` overload packet."""
        return getattr(getattr(torch.ops, NAMESPACE), self.name)

    def run(self, ctx, *args, **options):
        """The eager call of the op on ``ctx`` (no dispatcher)."""
        if self.eager is not None:
            return self.eager(ctx, *args, **options)
        return ctx(*args, **options)

    def __call__(self, ctx, args: tuple, *, grad: bool = False, **options):
        """Run the op with ``args`` (the schema's arguments without the handle, in order) and
        ``options`` (keyword arguments only the eager path takes, such as ``out``).

        The torch op is used under ``torch.compile``, or when ``grad`` says autograd must record
        the call; then every option must be unset (None), as a functional op has none."""
        check_context(self, ctx)
        eager = not (grad or torch.compiler.is_compiling())
        if self.backward is None:
            if not hasattr(ctx, "check_grad"):
                refuse_grad_as_call(self.name, args, (ctx,))
            elif not eager:  # a pattern's context checks its eager calls itself (_dispatch)
                inputs, _, given = ctx._bind(*args, **options)
                ctx.check_grad(inputs, given)
        if eager:
            return self.run(ctx, *args, **options)
        set_ = [k for k, v in options.items() if v is not None]
        if set_:
            if grad:
                raise ValueError(f"{self.name}: {', '.join(set_)} cannot be used when autograd "
                                 f"records the call (the differentiable op is functional)")
            # a graph break: torch.compile must not trace into the launch (it would trace the
            # kernels' address arithmetic and flag writes as if they were tensor code)
            return torch.compiler.disable(self.run)(ctx, *args, **options)
        h = self.handle_index
        return self.op(*args[:h], ctx.handle, *args[h:])


def _tensors(args, kwargs) -> list:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


def _no_backward(name: str, eager: Callable, op: Callable) -> Callable:
    """The Autograd kernel of an op without a backward. Called eagerly with an input that
    requires grad (grad mode on), it runs ``eager``, the op's own call, which refuses it as a
    call of its contexts (the peers fail the same call). Traced (fake tensors: torch.compile's
    AOT pass runs the op's forward with grad mode off, so the eager refusal never sees it; or
    meta tensors) it raises there, at compile time: without this kernel the compiled op
    returned a result that required grad and whose backward gave the inputs no gradient at
    all, with a warning only. Otherwise it runs the op below autograd. Every call of the torch
    op passes here (the eager Python functions do not: they skip the dispatcher); a Python
    kernel costs ~2.5 us a call on the CPU host that measured it, so the common case, grad mode
    off, checks nothing else and reaches its target with no lookup."""
    from torch._subclasses.fake_tensor import is_fake

    target = []  # the op's overload, found at the first call (the op is defined by then)

    def autograd_kernel(*args, **kwargs):
        if torch.is_grad_enabled():
            tensors = _tensors(args, kwargs)
            if any(t.requires_grad for t in tensors):
                # (meta tensors too: shape inference on this rank alone, where the eager
                # call's refusal would tell the peers of a call they never make)
                if any(is_fake(t) or t.device.type == "meta" for t in tensors):
                    raise RuntimeError(f"{name} has no backward, and an input requires grad: "
                                       f"call it under torch.no_grad() (inference) or pass "
                                       f"detached tensors")
                return eager(*args, **kwargs)
        if not target:
            target.append(op())
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return target[0](*args, **kwargs)

    return autograd_kernel


def _once_differentiable(name: str) -> Callable:
    """The backward of an op that is itself a backward with no backward of its own: a second
    derivative through it raises (as ``torch.autograd.function.once_differentiable`` does)
    instead of coming out as zeros."""
    def backward(ctx, *grads):
        raise RuntimeError(f"{name} is not differentiable: the op it is the backward of is "
                           f"differentiable once (no double backward, no Hessian-vector "
                           f"products through it)")
    return backward


def check_context(spec: OpSpec, ctx) -> None:
    """A clear error when an op is handed another op's context (or no context at all)."""
    if not isinstance(ctx, spec.context):
        raise TypeError(f"{spec.name}: ctx must be a {spec.context.__name__} (made with "
                        f"{spec.context.__name__}(world, ...)), got {type(ctx).__name__}")


def define(spec: OpSpec) -> OpSpec:
    """Define ``portable_overlap::<spec.name>`` from ``spec`` and add it to :data:`SPECS`."""
    if spec.name in SPECS:
        raise ValueError(f"op {spec.name} is defined twice")
    names = spec.arg_names
    if names.count("handle") != 1 or "int handle" not in spec.schema:
        raise ValueError(f"{spec.name}: the schema needs exactly one 'int handle' argument")
    h = spec.handle_index
    _LIB.define(spec.name + spec.schema)

    def _split(args, kwargs):
        args = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
        ctx = get_context(args[h])
        # the handle of another op's context would run that op (an all-reduce for a
        # reduce-scatter, with the fake's shape the reduce-scatter's): refused, as the op's
        # Python function refuses that context
        check_context(spec, ctx)
        return ctx, args[:h] + args[h + 1:]

    def kernel(*args, **kwargs):
        ctx, rest = _split(args, kwargs)
        result = spec.run(ctx, *rest)
        if spec.copies:
            result = tuple(t.clone() if i in spec.copies else t for i, t in enumerate(result))
        return result

    def fake(*args, **kwargs):
        ctx, rest = _split(args, kwargs)
        return spec.fake(ctx, *rest)

    _LIB.impl(spec.name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{spec.name}", fake, lib=_LIB)
    if spec.backward is not None:
        torch.library.register_autograd(f"{NAMESPACE}::{spec.name}", spec.backward,
                                        setup_context=spec.setup_context, lib=_LIB)
    else:  # (the eager call refuses an input that requires grad: check_grad)
        _LIB.impl(spec.name, _no_backward(spec.name, kernel, lambda: spec.op.default),
                  "Autograd")
    SPECS[spec.name] = spec
    spec.context.op_spec = spec  # a traced call of the context runs the op (PatternContext)
    return spec


#: the layer parts that are torch.library ops outside the op table, by name. They are not one
#: communication pattern each (the experts' gated GEMM has no communication; the fused
#: dispatch + gated GEMM and the one-launch layer run on the contexts of two patterns), so they
#: have no transports and no planner; torch.compile must still see each as one opaque node.
PARTS: dict = {}


def _handles(names) -> list:
    return [i for i, n in enumerate(names) if n == "handle" or n.endswith("_handle")]


@dataclasses.dataclass(frozen=True)
class PartSpec:
    """One layer part. ``schema``: its torch.library arguments and result; the ``int``
    arguments named ``handle`` or ``<name>_handle`` find contexts. ``run(*args, **options)``:
    the eager call, with the contexts themselves in the handles' places and the options only the
    eager path takes (``out=``, a tile config); ``fake(*args)``: empty results of the right
    shapes, same arguments. ``grad_args``: the arguments (by name) that must not require grad
    (the part has no backward); a part without them is the backward of an op, differentiable
    once (a second derivative through it raises). ``copies``: the results (by position) that
    are a context's own buffers in the eager call, which the context's next call overwrites:
    the op returns copies of them, new tensors as its fake says."""

    name: str
    schema: str
    run: Callable
    fake: Callable
    grad_args: tuple = ()
    copies: tuple = ()

    @property
    def arg_names(self) -> tuple:
        args = self.schema[self.schema.index("(") + 1: self.schema.rindex(")")]
        return tuple(_ARG.findall(args))

    @property
    def op(self):
        return getattr(getattr(torch.ops, NAMESPACE), self.name)

    def __call__(self, args: tuple, **options):
        """Run the part with ``args`` (the schema's arguments, contexts in the handles' places):
        eagerly, or under ``torch.compile`` as its torch op, or, where an option is set, as a
        graph break around the eager call."""
        names = self.arg_names
        refuse_grad_as_call(self.name, [a for n, a in zip(names, args) if n in self.grad_args],
                            args)
        if not torch.compiler.is_compiling():
            return self.run(*args, **options)
        if any(v is not None for v in options.values()):
            return torch.compiler.disable(self.run)(*args, **options)
        return self.op(*(a.handle if isinstance(a, ContextBase) else a for a in args))


def define_part(part: PartSpec) -> PartSpec:
    """Define ``portable_overlap::<part.name>`` from ``part`` and add it to :data:`PARTS`."""
    if part.name in PARTS or part.name in SPECS:
        raise ValueError(f"op {part.name} is defined twice")
    names = part.arg_names
    handles = _handles(names)
    _LIB.define(part.name + part.schema)

    def _contexts(args, kwargs):
        args = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
        return [get_context(a) if i in handles else a for i, a in enumerate(args)]

    def kernel(*args, **kwargs):
        result = part.run(*_contexts(args, kwargs))
        if part.copies:
            result = tuple(t.clone() if i in part.copies else t for i, t in enumerate(result))
        return result

    def fake(*args, **kwargs):
        return part.fake(*_contexts(args, kwargs))

    def refusing_kernel(*args, **kwargs):
        contexts = _contexts(args, kwargs)
        refuse_grad_as_call(part.name, [a for n, a in zip(names, contexts)
                                        if n in part.grad_args], contexts)
        return kernel(*args, **kwargs)

    _LIB.impl(part.name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{part.name}", fake, lib=_LIB)
    if part.grad_args:
        _LIB.impl(part.name, _no_backward(part.name, refusing_kernel, lambda: part.op.default),
                  "Autograd")
    else:  # a backward's op: differentiable inputs (its incoming gradient), no backward
        torch.library.register_autograd(f"{NAMESPACE}::{part.name}",
                                        _once_differentiable(part.name), lib=_LIB)
    PARTS[part.name] = part
    return part
