"""training.compile_cache: where compiled programs are kept, and that a second train.py run loads them.

The reuse case runs a program twice as a subprocess, with the default cache directory moved by
FLASH_LAYERS_CACHE into tmp_path: the first run writes every program it compiles; the second
compiles nothing: jax's own log (JAX_DEBUG_LOG_MODULES) reports a hit for each, and the cache's files
are as the first run left them. (tests/test_training.py checks that train.py writes its programs
to the default directory.)
"""

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from flash_layers.errors import UserError
from flash_layers.training import compile_cache
from flash_layers.training import config as config_lib

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_default_dir_follows_the_users_cache(monkeypatch, tmp_path):
  monkeypatch.delenv("FLASH_LAYERS_CACHE", raising=False)
  monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert compile_cache.default_dir() == str(tmp_path / "home/.cache/flash_layers/jax_compilation_cache")
  monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec: only absolute paths count
  assert compile_cache.default_dir() == str(tmp_path / "home/.cache/flash_layers/jax_compilation_cache")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compile_cache.default_dir() == str(tmp_path / "xdg/flash_layers/jax_compilation_cache")
  assert config_lib.default_config().compilation_cache_dir == compile_cache.default_dir()
  monkeypatch.setenv("FLASH_LAYERS_CACHE", str(tmp_path / "ours"))
  assert compile_cache.default_dir() == str(tmp_path / "ours/jax_compilation_cache")


def test_enable_sets_jax_options_and_empty_turns_it_off(tmp_path):
  options = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
             "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes")
  saved = {name: getattr(jax.config, name) for name in options}
  try:
    used = compile_cache.enable(tmp_path / "c")
    assert used == str(tmp_path / "c") and os.path.isdir(used)
    assert jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir == used
    # every program is kept, however quickly it compiled and however small it is
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
    assert compile_cache.enable("") is None and not jax.config.jax_enable_compilation_cache
  finally:
    for name, value in saved.items():
      jax.config.update(name, value)


def test_unusable_directory_is_a_user_error_naming_the_field(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  with pytest.raises(UserError, match=r"config.compilation_cache_dir: cannot create .*a_file/cache"):
    compile_cache.enable(blocker / "cache")
  config = config_lib.default_config()
  config.compilation_cache_dir = None
  config.data.dataset = "bbc_news"
  with pytest.raises(config_lib.ConfigError, match="config.compilation_cache_dir: must be a directory"):
    config_lib.validate(config, num_devices=1, check_data=False)


def _entries(cache: pathlib.Path) -> dict[str, int]:
  """Cache file -> its mtime (ns)."""
  return {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}


# A program as train.py and eval.py start: the cache from the default config, then compiles (two
# small programs, well under jax's default one-second floor, and one that calls the first).
PROGRAM = """
from flash_layers.training import compile_cache, config
compile_cache.enable(config.default_config().compilation_cache_dir)
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sin(x) * 2)
g = jax.jit(lambda x: f(x).sum() + jnp.cos(x).mean())
print(float(f(jnp.ones(3)).sum()), float(g(jnp.ones((4, 4)))))
"""


def test_second_run_loads_every_program_from_the_default_cache(tmp_path):
  env = dict(os.environ, FLASH_LAYERS_CACHE=str(tmp_path / "user_cache"), PYTHONPATH=str(REPO),
             JAX_DEBUG_LOG_MODULES="jax._src.compiler")
  cache = tmp_path / "user_cache" / "jax_compilation_cache"

  def run() -> tuple[str, int, int]:
    """(stdout, cache misses, cache hits) of one run."""
    result = subprocess.run([sys.executable, "-c", PROGRAM], env=env, cwd=REPO, check=True,
                            capture_output=True, text=True, timeout=300)
    log = result.stdout + result.stderr
    return (result.stdout, log.count("PERSISTENT COMPILATION CACHE MISS"),
            log.count("Persistent compilation cache hit"))

  out, misses, hits = run()
  written = _entries(cache)
  assert misses >= 2 and hits == 0 and len(written) == misses  # every program kept, however quick
  again, misses_2, hits_2 = run()
  assert (again, misses_2, hits_2) == (out, 0, misses)  # each one loaded, the same results
  assert _entries(cache) == written  # nothing written again


def test_lowered_only_for_traces_one_platform_and_changes_nothing_here():
  """Inside the training/eval sharding context "auto" attention traces only the mesh platform's
  choice (no TPU/GPU kernels: most of an encoder's trace time), with bitwise the same result."""
  import flash_layers as fl
  from flash_layers import lowering
  from flash_layers.parallel.mesh import make_mesh
  from flash_layers.training import sharding as sharding_lib

  q, k, v = (jax.random.normal(jax.random.key(i), (2, 256, 2, 16)) for i in range(3))
  segments = jax.numpy.asarray([[1] * 100 + [2] * 156, [1] * 200 + [0] * 56], jax.numpy.int32)
  attend = lambda q, k, v: fl.attention(q, k, v, impl="auto", segment_ids=segments)
  everywhere = jax.make_jaxpr(attend)(q, k, v)
  with sharding_lib.sharding_context(make_mesh(data=1, devices=jax.devices()[:1])):
    assert lowering.only_platform() == "cpu"
    here_only = jax.make_jaxpr(attend)(q, k, v)
    only_out = jax.jit(attend)(q, k, v)
  assert "pallas_call" in str(everywhere) and "pallas_call" not in str(here_only)
  assert lowering.only_platform() is None
  np.testing.assert_array_equal(np.asarray(only_out), np.asarray(jax.jit(attend)(q, k, v)))
  with pytest.raises(ValueError, match="platform must be None or one of"), lowering.lowered_only_for("gpu"):
    pass
