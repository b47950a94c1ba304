"""``ktc doctor --calibrate``'s kernel measurements: valid weights in every CPU scheme, and rates."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ktc.formats.hardware_profile import HardwareProfile
from ktc.formats.schemes import get_scheme
from ktc.runtime import calibrate


@pytest.mark.parametrize("scheme", calibrate.cpu_schemes())
def test_probe_weights_are_valid_rows_of_every_scheme(scheme):
    raw = calibrate.scheme_rows(scheme, 70, 256)  # a 64-row block tiled: 70 rows
    assert raw.shape == (70, get_scheme(scheme).matrix_bytes(1, 256)) and raw.dtype == np.uint8
    values = get_scheme(scheme).dequantize(raw, 256)
    assert np.all(np.isfinite(values)) and np.any(values != 0)


def test_weights_read_through_a_map_as_a_bundle_is(tmp_path):
    """``mapped``: the probes' weights read through a file's map, as ``ktc run`` reads a bundle
    (the file gone from the folder, its bytes the same), and rates measured on them."""
    raw = calibrate.scheme_rows("q4_0", 64, 256)
    mapped = calibrate.mapped_copy(raw, str(tmp_path))
    assert np.array_equal(mapped.reshape(raw.shape), raw) and not mapped.flags.writeable
    assert not os.listdir(tmp_path)
    got = calibrate.scheme_bandwidths(("int8", "q4_0"), rounds=1, calls=1, working_set=1 << 20,
                                      shapes=((2, 256, 128), (2, 512, 256)),
                                      matrix_calls=((64, 4096), (None, 1024), (None, 4096), (None, 7168)),
                                      mapped=str(tmp_path))
    assert all(v > 0 for table in ("matrix", "experts") for v in got[table].values())
    assert set(got["matrix"]) == {"int8", "q4_0"}


def test_kept_probes_are_measured_again_not_made_again(monkeypatch):
    """A second calibration with the first one's probes kept measures the same probe objects
    (benchmarks/predict.py brackets a decode with calibrations seconds apart)."""
    made = []
    for cls in (calibrate._ExpertsProbe, calibrate._MatrixProbe):
        monkeypatch.setattr(cls, "__init__", _counting(cls.__init__, made))
    kept: dict = {}
    args = dict(rounds=1, calls=1, working_set=1 << 20, shapes=((2, 256, 128), (2, 512, 256)),
                matrix_calls=((64, 4096), (None, 1024), (None, 4096)), kept=kept)
    first = calibrate.scheme_bandwidths(("int8", "q4_0"), **args)
    assert len(made) == len(kept) == 2 * (2 + 3)  # two schemes' expert and matrix probes
    objects = dict(kept)
    second = calibrate.scheme_bandwidths(("int8", "q4_0"), **args)
    assert len(made) == 10 and all(kept[key] is probe for key, probe in objects.items())
    assert set(second) == set(first) and all(v > 0 for v in second["matrix"].values())


def _counting(init, made):  # type: ignore[no-untyped-def]
    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(type(self).__name__)
        init(self, *args, **kwargs)

    return counted


def test_rates_are_measured_for_both_paths():
    got = calibrate.scheme_bandwidths(("int8", "q4_0", "f32"), rounds=1, calls=1, working_set=1 << 20,
                                      shapes=((2, 256, 128), (2, 512, 256)),
                                      matrix_calls=((64, 4096), (None, 1024), (None, 4096), (None, 7168)))
    assert set(got["matrix"]) == {"int8", "q4_0", "f32"}
    assert set(got["experts"]) <= {"int8", "q4_0"} and "int8" in got["experts"]  # f32 experts: no fused call
    # a rate at each row length of the larger calls (4096 columns' too, beside "matrix")
    assert {path for path in got if path.startswith("matrix@")} == {"matrix@1024", "matrix@4096", "matrix@7168"}
    assert all(set(got[path]) == {"int8", "q4_0", "f32"} for path in got if path.startswith("matrix@"))
    assert all(v > 0 for table in ("matrix", "experts", "matrix@1024", "matrix@7168") for v in got[table].values())
    assert all(v >= 0 for path in ("experts_call", "matrix_call") for v in got[path + "_seconds"].values())
    HardwareProfile(vram_bytes=0, ram_bytes=1, cpu_scheme_bandwidth=got)  # a profile takes every table
    assert got["matrix_call_bytes"]["q4_0"] == get_scheme("q4_0").matrix_bytes(64, 4096)
    int8 = get_scheme("int8")
    assert got["experts_call_bytes"]["int8"] == 2 * (int8.matrix_bytes(256, 256) + int8.matrix_bytes(256, 128))


def test_probes_read_twice_the_last_level_cache(tmp_path, monkeypatch):
    """The bytes a rate is measured over exceed the largest cache the OS reports (a 480 MiB L3
    held the 128 MiB probes: their rates came out 13-18% above memory's)."""
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "491520K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert calibrate.last_level_cache_bytes(str(tmp_path)) == 480 << 20
    assert calibrate.last_level_cache_bytes(str(tmp_path / "none")) == 0
    pages = {"SC_PAGE_SIZE": 4096, "SC_AVPHYS_PAGES": (64 << 30) // 4096}  # 64 GiB free
    monkeypatch.setattr(calibrate.os, "sysconf", lambda name: pages[name])
    monkeypatch.setattr(calibrate, "last_level_cache_bytes", lambda: 480 << 20)
    assert calibrate.probe_bytes() == 960 << 20
    pages["SC_AVPHYS_PAGES"] = (8 << 30) // 4096  # 8 GiB free: a sixteenth of it a probe
    assert calibrate.probe_bytes() == 512 << 20
    monkeypatch.setattr(calibrate, "last_level_cache_bytes", lambda: 32 << 20)
    assert calibrate.probe_bytes() == calibrate.WORKING_SET


@pytest.mark.parametrize("scheme", ["int8", "q4_0", "q4_k", "bf16"])
def test_a_schemes_matrix_probes_share_one_working_set(scheme):
    """Rows of a quarter the length read the bytes of the full-length probe: valid blocks of the
    scheme (int8's row scale aside), no second working set."""
    from ktc.runtime import kernels

    full = calibrate._MatrixProbe(scheme, 1 << 20, None, 1024)
    quarter = calibrate._MatrixProbe(scheme, 1 << 20, None, 256, full.raw)
    assert np.shares_memory(quarter.raw, full.raw)
    assert quarter.raw.shape[1] == get_scheme(scheme).matrix_bytes(1, 256)
    quarter.run()
    if scheme != "int8":
        at = quarter.parts[0]
        values = get_scheme(scheme).dequantize(at.view(np.uint8).reshape(at.shape[0], -1), 256)
        expect = values @ quarter.x
        np.testing.assert_allclose(kernels.matvec(at, scheme, quarter.x), expect, rtol=0.05,
                                   atol=0.05 * float(np.abs(expect).max()))


def test_a_large_matrix_call_reads_other_bytes_than_the_last():
    """A large call's rows are the next quarter of the working set, not the same bytes again: a
    32 MiB L3 kept enough of one 128 MiB call re-read to make q8_0 read 10% faster than a
    lm_head of 330 MB in a decode."""
    probe = calibrate._MatrixProbe("q8_0", 4 << 20, None, 1024)
    assert len(probe.parts) == 4
    assert not any(np.shares_memory(a, b) for i, a in enumerate(probe.parts) for b in probe.parts[i + 1:])
    seen = set()
    for _ in range(4):
        seen.add(probe.at)
        probe.run()
    assert seen == {0, 1, 2, 3} and probe.at == 0
    assert calibrate.WORKING_SET >= 4 * calibrate.CALL_BYTES


@pytest.mark.parametrize("scheme", ["q8_0", "q4_k"])
def test_a_schemes_expert_probes_share_one_file(scheme):
    """The smaller call's probe reads the larger one's bytes (whole blocks at its own offsets)."""
    large, small = (2, 512, 1024), (4, 256, 256)
    assert calibrate._ExpertsProbe.bytes_needed(scheme, large, 1 << 22) >= \
        calibrate._ExpertsProbe.bytes_needed(scheme, small, 1 << 22)
    first = calibrate._ExpertsProbe(scheme, large, 1 << 22)
    second = calibrate._ExpertsProbe(scheme, small, 1 << 22, first.file)
    assert second.file is first.file and first.file.nbytes == calibrate._ExpertsProbe.bytes_needed(scheme, large,
                                                                                                   1 << 22)
    assert int(second.offsets[-1][1].max()) + get_scheme(scheme).matrix_bytes(256, 256) <= first.file.nbytes
    first.run()
    second.run()


def test_device_rates_on_torchs_cpu_device():
    # the CUDA path (pinned host memory, synchronised timing) is the same code; this machine has
    # no GPU, so its CPU device stands in
    got = calibrate.device_bandwidths("cpu", nbytes=4 << 20, rounds=2)
    assert set(got) == {"gpu_bandwidth", "pcie_bandwidth"} and all(v > 0 for v in got.values())


@pytest.mark.gpu
def test_device_rates_on_cuda():
    got = calibrate.device_bandwidths("cuda", nbytes=256 << 20, rounds=3)
    assert got["gpu_bandwidth"] > got["pcie_bandwidth"] > 1e9


def test_prefill_rate_is_the_batched_products_or_unknown(monkeypatch):
    """The prefill offload's CPU rate: ops a second of the batched kernel where this CPU has
    it, and 0 (unknown: the planner then keeps llama.cpp's threshold) where it does not."""
    from ktc.runtime import lanes

    ops = calibrate.prefill_ops(tokens=16, rows_=64, cols=256, rounds=1, calls=1)
    assert ops > 0 if lanes.fits("q8_0", 256) else ops == 0.0
    monkeypatch.setattr(lanes, "fits", lambda scheme, cols: False)
    assert calibrate.prefill_ops(tokens=16, rows_=64, cols=256, rounds=1, calls=1) == 0.0


def test_the_device_steps_fixed_cost_on_torchs_cpu_device(tmp_path, monkeypatch):
    """The device path's extra cost a layer's step, on torch's CPU device (the CUDA path is the
    same code with synchronised timing): a probe layer whose every step runs one expert from a
    slot held fixed and one on the CPU, against every expert on the CPU; measured and finite."""
    import ktc.calibrate as calibrate_module
    from ktc.runtime.experts import ExpertSet

    path = calibrate_module.probe_bundles(str(tmp_path), probes=calibrate_module.PROBES[:1])[0]
    seen = []
    close = ExpertSet.close

    def closing(self):  # type: ignore[no-untyped-def]
        if self.cache is not None:
            seen.append((self.cache.counters.hits, self.cache.counters.misses, self.cache.counters.uploads))
        close(self)

    monkeypatch.setattr(ExpertSet, "close", closing)
    seconds = calibrate_module.device_step("cpu", path, rounds=2, steps=8)
    assert 0.0 <= seconds < 0.5
    steps = (1 + 2) * 8  # the warm-up round and two timed ones
    assert seen == [(steps, steps, 0)]  # one hit and one miss a step; nothing copied after the load


@pytest.mark.skipif(not calibrate.interleaved("q4_0"), reason="ktc run interleaves nothing on this CPU (no VNNI)")
@pytest.mark.parametrize("scheme", ["q4_0", "q4_k"])
def test_probes_read_interleaved_copies_where_ktc_run_does(scheme):
    """With ``interleave`` (``scheme_bandwidths``' default), a scheme that ``ktc run`` reads
    from interleaved copies is measured so: the experts' file holds the scheme's rows
    interleaved and the one-token call reads them as the interleaved kinds; a matrix's parts
    are interleaved copies of valid rows, multiplied by ``interleave.matvec`` (what the stored
    rows give, within the float order). Without it, the stored layout. int8 experts are read
    from copies in q8_0's layout (``interleave.COPIES``), their rate over int8's bytes; an int8
    matrix (a projection's) from its stored rows."""
    from ktc.runtime import interleave, kernels, rows

    shape = (4, 256, 512)
    # and (q4_0) rows that do not fill whole units (3 and 5 blocks, units of 2), read as
    # ExpertSet reads them, from copies with a tail
    for probed in (shape, (4, 96, 160)) if scheme in interleave.LAYOUTS else (shape,):
        probe = calibrate._ExpertsProbe(scheme, probed, 1 << 22, interleave=True)
        assert probe.tables is not None and probe.tables[0][0] == probe.tables[2][0] == rows.INTERLEAVED[scheme]
        row_bytes = get_scheme(scheme).matrix_bytes(1, probed[1])
        assert probe.tables[1][0] == interleave.copy_row_bytes(scheme, row_bytes)
        first = np.asarray(probe.file[:2 * probed[2] * probe.tables[1][0]]).reshape(2 * probed[2], -1)
        np.testing.assert_array_equal(interleave.unpack(first, scheme, row_bytes),
                                      calibrate.scheme_rows(scheme, 2 * probed[2], probed[1]))
        assert probe.bytes_per_call == probed[0] * sum(get_scheme(scheme).matrix_bytes(r, c) for r, c in (
            (2 * probed[2], probed[1]), (probed[1], probed[2])))  # the rate over the stored bytes
        probe.run()
    assert calibrate._ExpertsProbe(scheme, shape, 1 << 22).tables is None
    int8 = calibrate._ExpertsProbe("int8", shape, 1 << 22, interleave=True)
    assert int8.tables is not None and int8.tables[0][0] == int8.tables[2][0] == rows.INTERLEAVED["q8_0"]
    assert int8.bytes_per_call == shape[0] * sum(get_scheme("int8").matrix_bytes(r, c)
                                                 for r, c in ((2 * shape[2], shape[1]), (shape[1], shape[2])))
    int8.run()
    assert not calibrate._MatrixProbe("int8", 1 << 22, None, 1024, interleave=True).interleaved

    matrix = calibrate._MatrixProbe(scheme, 1 << 22, None, 1024, interleave=True)
    assert matrix.interleaved and matrix.rows_per_call % interleave.GROUP == 0
    matrix.run()
    stored = interleave.unpack(matrix.parts[0], scheme)
    want = kernels.matvec(stored, scheme, matrix.x)
    np.testing.assert_allclose(matrix.out, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    assert not calibrate._MatrixProbe(scheme, 1 << 22, None, 1024).interleaved
