"""The launcher's cache of Horovod's build checks: asked once per build of Horovod's extensions,
never trusted when they changed or when the cache is unreadable, and Horovod's own answer given."""

import json
import os

from elastic_ext.launch import build_check


def counting(value):
    calls = []

    def check(verbose=False):
        calls.append(verbose)
        return value
    return check, calls


def extensions(tmp_path):
    lib = tmp_path / "horovod" / "torch" / "mpi_lib_v2.cpython-311-x86_64-linux-gnu.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"x" * 10)
    return str(tmp_path / "horovod"), lib


def test_the_answer_is_asked_once_and_then_read_from_the_cache(tmp_path):
    horovod_dir, _ = extensions(tmp_path)
    path = str(tmp_path / "cache" / "horovod_build.json")
    check, calls = counting(True)
    answer = build_check.cached("gloo_built", check, build_check.extensions_key(horovod_dir), path)
    assert [answer(), answer(), answer()] == [True, True, True]
    assert calls == [False]
    assert json.load(open(path))["gloo_built"]["value"] is True


def test_a_changed_extension_is_asked_again(tmp_path):
    horovod_dir, lib = extensions(tmp_path)
    path = str(tmp_path / "horovod_build.json")
    check, calls = counting(False)
    assert build_check.cached("mpi_built", check, build_check.extensions_key(horovod_dir), path)() is False
    lib.write_bytes(b"y" * 20)  # a rebuilt Horovod
    os.utime(lib, ns=(1, 1))
    assert build_check.cached("mpi_built", check, build_check.extensions_key(horovod_dir), path)() is False
    assert calls == [False, False]


def test_an_unreadable_cache_or_a_verbose_call_asks_horovod(tmp_path):
    horovod_dir, _ = extensions(tmp_path)
    path = tmp_path / "horovod_build.json"
    path.write_text("{not json")
    check, calls = counting(None)
    answer = build_check.cached("gloo_built", check, build_check.extensions_key(horovod_dir), str(path))
    assert answer() is None and answer(verbose=True) is None
    assert calls == [False, True]
    assert json.load(open(path))["gloo_built"] == {"key": build_check.extensions_key(horovod_dir), "value": None}


def test_an_unwritable_cache_still_gives_horovods_answer(tmp_path):
    horovod_dir, _ = extensions(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    check, calls = counting(True)
    answer = build_check.cached("gloo_built", check, build_check.extensions_key(horovod_dir),
                                str(blocker / "sub" / "horovod_build.json"))
    assert answer() is True and answer() is True
    assert calls == [False, False]


def test_the_cache_lives_under_xdg_cache_home_when_set(tmp_path):
    assert build_check.cache_path({"XDG_CACHE_HOME": str(tmp_path)}) == str(tmp_path / "elastic_ext" /
                                                                            "horovod_build.json")
