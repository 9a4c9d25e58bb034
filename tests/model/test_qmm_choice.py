"""The few-row kernel is never slower than MLX's qmm (model/qmm_choice.py): per shape the
faster of the two is kept, a stored table is trusted after one spot check, and the loader
stores it per chip and MLX version (loading/backend.py)."""

from dflash_mlx.model import qmm_choice


def _chooser(verdicts: dict):
    """A chooser whose timer says, per key being timed, whether the kernel wins."""
    current = {}

    def timer(kind, fn):
        wins = verdicts[current["key"]]
        return (0.0 if wins else 1.0) if kind == "kernel" else 0.5

    chooser = qmm_choice.Chooser(timer=timer)

    def use(key):
        current["key"] = key
        return chooser.use_kernel(lambda: None, lambda: None, key)

    return chooser, use


def test_each_shape_keeps_the_faster_and_is_timed_once():
    chooser, use = _chooser({"4": True, "8": False})
    assert use("4") and not use("8") and use("4") and not use("8")
    assert chooser.timed == 2 and chooser.table == {"4": True, "8": False}
    assert chooser.report() == "faster than MLX for 1 of 2 shapes timed"


def test_a_stored_table_is_trusted_after_one_spot_check_and_saved_as_it_grows():
    saved = []
    chooser, use = _chooser({"4": True, "8": False, "16": True})
    chooser.restore({"4": True, "8": False, "bad": "x"}, saved.append)
    assert use("4") and chooser.timed == 1  # the spot check agrees
    assert not use("8") and chooser.timed == 1  # taken from the table, not timed
    assert use("16") and chooser.timed == 2  # a shape the table lacks
    assert saved[-1] == {"4": True, "8": False, "16": True}


def test_a_spot_check_that_disagrees_drops_the_stored_table():
    chooser, use = _chooser({"4": False, "8": True})
    chooser.restore({"4": True, "8": False}, None)
    assert not use("4")  # the machine changed its mind: measured anew
    assert use("8") and chooser.timed == 2


def test_the_loader_stores_the_table_per_chip_and_mlx_version(tmp_path, monkeypatch):
    from dflash_mlx.loading import backend

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(qmm_choice, "CHOOSER", qmm_choice.Chooser())
    backend.qmm_choices()
    qmm_choice.CHOOSER.saver({"2,64,64,4,64,mlx.core.float16": True})
    again = qmm_choice.Chooser()
    monkeypatch.setattr(qmm_choice, "CHOOSER", again)
    backend.qmm_choices()
    assert again.stored == {"2,64,64,4,64,mlx.core.float16": True}
    assert len(list((tmp_path / "qmm").glob("*.json"))) == 1
