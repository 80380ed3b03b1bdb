"""Which build of the CPU kernels a process runs (kernels/isa.py, kernels/build.py): chosen from the CPU's
flags, overridable by device.isa, refused in one line where the CPU lacks it, each build cached apart."""

import logging
import os

import pytest

from inferlab.api import load_engine
from inferlab.errors import InvalidRequestError
from inferlab.kernels import build
from inferlab.kernels import isa as isa_module
from inferlab.kernels.build import active_isa, use_isa
from inferlab.kernels.isa import ISAS, resolve_isa, supported_isas
from inferlab.paths import cache_dir

AVX2_ONLY = frozenset("fpu sse sse2 avx f16c fma avx2 bmi2".split())
AVX512 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}


def test_auto_takes_the_widest_set_the_cpu_runs(monkeypatch):
    monkeypatch.setattr(isa_module, "cpu_flags", lambda: AVX512)
    assert supported_isas() == ["avx2", "avx512"] and resolve_isa("auto").name == "avx512"
    assert resolve_isa("avx2").name == "avx2"
    monkeypatch.setattr(isa_module, "cpu_flags", lambda: AVX2_ONLY)
    assert supported_isas() == ["avx2"] and resolve_isa("auto").name == "avx2"
    monkeypatch.setattr(isa_module, "cpu_flags", lambda: AVX512 - {"avx512_bf16"})  # AVX-512 without BF16
    assert resolve_isa("auto").name == "avx2"
    monkeypatch.setattr(isa_module, "cpu_flags", lambda: frozenset({"sse2", "avx"}))
    assert supported_isas() == [] and resolve_isa("auto") is None  # no kernels: the portable path


@pytest.mark.parametrize("granted", [True, False])
def test_the_amx_build_runs_where_the_cpu_has_tiles_and_linux_grants_them(monkeypatch, granted):
    monkeypatch.setattr(isa_module, "cpu_flags", lambda: AVX512 | {"amx_tile", "amx_bf16", "amx_int8"})
    monkeypatch.setattr(isa_module, "amx_bf16_usable", lambda: granted)
    if granted:
        assert supported_isas() == ["avx2", "avx512", "amx"] and resolve_isa("auto").name == "amx"
        return
    assert supported_isas() == ["avx2", "avx512"] and resolve_isa("auto").name == "avx512"
    with pytest.raises(InvalidRequestError, match=r"device.isa=amx: Linux does not let this process use AMX tiles"):
        resolve_isa("amx")


def test_a_set_the_cpu_lacks_or_no_such_set_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(isa_module, "cpu_flags", lambda: AVX2_ONLY)
    with pytest.raises(
        InvalidRequestError,
        match=r"device.isa=avx512: this CPU lacks avx512_bf16, avx512_vnni, "
        r"avx512bw, avx512f, avx512vl \(it runs: avx2\)",
    ):
        resolve_isa("avx512")
    with pytest.raises(
        InvalidRequestError, match=r"device.isa='avx1024'; use one of \['auto', 'avx2', 'avx512', 'amx'\]"
    ):
        resolve_isa("avx1024")


def test_load_engine_checks_device_isa_before_loading_anything():
    with pytest.raises(InvalidRequestError, match="device.isa='sse'"):
        load_engine(model="tiny-random", device="cpu", **{"device.isa": "sse"})


@pytest.mark.skipif(not supported_isas(), reason="no AVX2 CPU here")
def test_each_set_builds_into_its_own_cache_dir_and_the_choice_is_logged(caplog):
    before = active_isa()
    try:
        for name in supported_isas():
            with caplog.at_level(logging.INFO, logger="inferlab.kernels.build"):
                chosen = use_isa(name)
            if chosen is None:
                pytest.skip("no C++ toolchain here")
            assert chosen == name and active_isa() is ISAS[name]
            assert any(ISAS[name].about in record.getMessage() for record in caplog.records)
            assert list((cache_dir() / "kernels").glob(f"torch-*/{name}/inferlab_kernels_{name}.so"))
    finally:
        use_isa(before.name if before else "auto")


def test_make_kernels_builds_every_set_the_cpu_runs_and_leaves_out_those_that_fail(monkeypatch):
    monkeypatch.setattr(build, "supported_isas", lambda: ["avx2", "avx512"])
    monkeypatch.setattr(build, "load_isa", lambda name: name == "avx2")  # as with a compiler lacking AVX-512 BF16
    assert build.build_every_isa() == ["avx2"]


def test_auto_falls_back_to_a_narrower_build_where_a_wider_one_does_not_build(monkeypatch):
    before = active_isa()
    monkeypatch.setattr(isa_module, "cpu_flags", lambda: AVX512)
    monkeypatch.setattr(build, "load_isa", lambda name: name == "avx2")  # as with a compiler lacking AVX-512 BF16
    try:
        assert use_isa("auto") == "avx2" and active_isa().name == "avx2"
        assert use_isa("avx512") is None and not build.cpu_gemv_available()  # asked for by name: portable path
    finally:
        monkeypatch.undo()
        use_isa(before.name if before else "auto")


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_recent_one_kept(tmp_path, caplog, capsys):
    """torch's builder waits for its `lock` to go away; one left by a killed build would make every later load wait
    forever. Older than any build: removed, with a warning; recent (another process building now): waited on."""
    lock = tmp_path / "lock"
    lock.touch()
    build.clear_stale_lock(tmp_path, max_age_s=600)
    assert lock.exists() and "waiting for another process's kernel build" in capsys.readouterr().err
    old = lock.stat().st_mtime - 601
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="inferlab.kernels.build"):
        build.clear_stale_lock(tmp_path, max_age_s=600)
    assert not lock.exists() and "did not finish" in caplog.text
    build.clear_stale_lock(tmp_path)  # no lock: nothing to do
