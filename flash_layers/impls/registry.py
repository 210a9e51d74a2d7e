"""The registry of attention impls: registration checks the interface, queries replace `getattr`.

`register(impl)` admits an object only if it satisfies `base.Impl` (a non-empty ``name``,
``unsupported``, ``kernel`` and ``attend`` callable the way `dispatch` calls them) and its
``capabilities`` are honest: every declared method capability exists with the documented
signature, every method capability it defines is declared, every name is one of
`base.CAPABILITIES`. A malformed impl fails at import, with a message naming the impl and what is
wrong, instead of at its first call.

Callers ask `impl_has(name, capability)` or `impls_with(capability)`. This module imports only
`base`, so any impl module may import it without a cycle; the shipped impls are registered by
`impls/__init__.py`.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Mapping
from typing import Any

from flash_layers.impls.base import CAPABILITIES, FEATURE_CAPABILITIES, METHOD_CAPABILITIES, Impl


class RegistrationError(TypeError):
  """An impl does not satisfy the interface (`base.Impl`) or declares capabilities falsely."""


_ARG = object()  # stands for any argument when probing a signature

# How dispatch calls each method: (positional arguments, keyword arguments), bound against the
# method's signature at registration.
_REQUIRED_CALLS: dict[str, tuple[int, tuple[str, ...]]] = {
    "unsupported": (2, ()),                # (request, platform)
    "kernel": (2, ()),                     # (request, platform)
    "attend": (3, ("request", "args")),    # (q, k, v, *, request, args)
}
_CAPABILITY_CALLS: dict[str, tuple[int, tuple[str, ...]]] = {
    "attention_backward": (6, ("request", "args")),  # (q, k, v, lse, delta, d_out, *, request, args)
    "block_stats": (3, ()),                          # (request, args, platform)
    "grid_steps": (3, ()),                           # (request, args, platform)
    "decode_unserved": (2, ()),                      # (request, platform)
    "tuning_space": (2, ()),                         # (request, platform)
    "cpu_loop_tile": (1, ()),                        # (request)
}
assert set(_CAPABILITY_CALLS) == set(METHOD_CAPABILITIES)


def check_callable(owner: str, obj: Any, method: str, call: tuple[int, tuple[str, ...]]) -> None:
  """Raise RegistrationError unless `obj.method` exists and accepts `call`'s arguments."""
  fn = getattr(obj, method, None)
  positional, keywords = call
  wanted = ", ".join(["_"] * positional + [f"{k}=..." for k in keywords])
  if not callable(fn):
    raise RegistrationError(f"{owner} has no method {method}({wanted})")
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):  # a builtin without a signature: trust it
    return
  try:
    signature.bind(*([_ARG] * positional), **{k: _ARG for k in keywords})
  except TypeError as e:
    raise RegistrationError(f"{owner}.{method}{signature} cannot be called as {method}({wanted}): "
                            f"{e}") from None


def check(impl: Any) -> None:
  """Raise RegistrationError unless `impl` satisfies `base.Impl` and its capabilities are true."""
  name = getattr(impl, "name", None)
  if not isinstance(name, str) or not name:
    raise RegistrationError(f"an impl needs a non-empty str `name`; {impl!r} has {name!r}")
  owner = f"impl {name!r} ({type(impl).__name__})"
  for method, call in _REQUIRED_CALLS.items():
    check_callable(owner, impl, method, call)
  declared = getattr(impl, "capabilities", None)
  if not isinstance(declared, (frozenset, set)) or not all(isinstance(c, str) for c in declared):
    raise RegistrationError(f"{owner} needs `capabilities`, a frozenset of names from "
                            f"{CAPABILITIES}; got {declared!r}")
  unknown = sorted(set(declared) - set(CAPABILITIES))
  if unknown:
    raise RegistrationError(f"{owner} declares unknown capabilities {unknown}; allowed: {CAPABILITIES}")
  for capability, call in _CAPABILITY_CALLS.items():
    if capability in declared:
      check_callable(owner, impl, capability, call)
    elif callable(getattr(impl, capability, None)):
      raise RegistrationError(f"{owner} defines {capability}() but does not declare it in "
                              "`capabilities`: declare it, or rename the method")
  sizes = getattr(impl, "block_size_types", ())
  if not isinstance(sizes, tuple) or not all(isinstance(t, type) for t in sizes):
    raise RegistrationError(f"{owner}.block_size_types must be a tuple of block-size classes; got {sizes!r}")


class Registry:
  """Impls by name, in registration order."""

  def __init__(self) -> None:
    self._impls: dict[str, Impl] = {}
    self.impls: Mapping[str, Impl] = types.MappingProxyType(self._impls)  # read-only view

  def register(self, impl: Impl) -> Impl:
    """Admit `impl` (see `check`); a second impl of the same name is refused."""
    check(impl)
    if impl.name in self._impls:
      raise RegistrationError(f"an impl named {impl.name!r} is already registered "
                              f"({type(self._impls[impl.name]).__name__})")
    self._impls[impl.name] = impl
    return impl

  def get(self, name: str) -> Impl:
    try:
      return self._impls[name]
    except KeyError:
      raise ValueError(f"impl must be one of {tuple(self._impls)}; got {name!r}") from None

  def names(self) -> tuple[str, ...]:
    return tuple(self._impls)

  def impl_has(self, name: str, capability: str) -> bool:
    """Whether impl `name` declared `capability` (one of `base.CAPABILITIES`)."""
    _check_capability(capability)
    return capability in self.get(name).capabilities

  def impls_with(self, capability: str) -> tuple[str, ...]:
    """The registered impls that declared `capability`, in registration order."""
    _check_capability(capability)
    return tuple(n for n, impl in self._impls.items() if capability in impl.capabilities)

  def block_size_types(self, name: str) -> tuple[type, ...]:
    """The block-size classes impl `name` reads (its ``block_size_types``; () when it reads none)."""
    return getattr(self.get(name), "block_size_types", ())

  def method(self, name: str, capability: str) -> Callable | None:
    """Impl `name`'s method for a method capability, or None when it did not declare it."""
    if capability not in METHOD_CAPABILITIES:
      raise ValueError(f"capability must be one of {METHOD_CAPABILITIES}; got {capability!r}"
                       + (" (a feature: ask impl_has)" if capability in FEATURE_CAPABILITIES else ""))
    return getattr(self.get(name), capability) if self.impl_has(name, capability) else None


def _check_capability(capability: str) -> None:
  if capability not in CAPABILITIES:
    raise ValueError(f"capability must be one of {CAPABILITIES}; got {capability!r}")


# The package's registry (filled by impls/__init__.py) and its queries.
DEFAULT = Registry()
REGISTRY = DEFAULT.impls
register = DEFAULT.register
get = DEFAULT.get
names = DEFAULT.names
impl_has = DEFAULT.impl_has
impls_with = DEFAULT.impls_with
method = DEFAULT.method
block_size_types = DEFAULT.block_size_types
