"""What model.fit forgets between two calls is carried: the epoch's metric sums (summed over the ranks
at every epoch's end and at every commit inside an epoch) and ReduceLROnPlateau's and EarlyStopping's
counters; EarlyStopping(restore_best_weights=True) is refused. One process, Keras 3, ranks simulated
by the allgather's rows (the multi-process check is the corpus' keras_fit_callbacks, under horovodrun)."""

import os

import numpy as np
import pytest

from elastic_ext.errors import ConfigError, StateError


@pytest.fixture(scope="module")
def keras():
    """Keras 3, imported by this module's tests, not at its collection (each pytest-xdist worker collects
    every module, and one runs these)."""
    os.environ.pop("TF_USE_LEGACY_KERAS", None)
    import keras
    return keras


@pytest.fixture(scope="module")
def fit_carry(keras):
    from elastic_ext.tensorflow import fit_carry
    return fit_carry


class Ranks:
    """A binding whose allgather stacks this rank's row with the other ranks' given rows."""

    def __init__(self, rank, others):
        self._rank, self.others = rank, others

    def rank(self):
        return self._rank

    def allgather(self, array, name):
        return np.concatenate([array] + [o[None, :] for o in self.others])


def trained_model(keras):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    model.fit(np.ones((4, 3), "float32"), np.zeros((4, 2), "float32"), batch_size=4, epochs=1, verbose=0)
    return model


def sums(model):
    return [np.asarray(v.numpy(), dtype=np.float64) for m in model.metrics for v in m.variables]


def test_the_epoch_logs_are_the_whole_job_s_and_a_resumed_epoch_starts_from_the_committed_sums(keras, fit_carry):
    FitCarry = fit_carry.FitCarry
    model = trained_model(keras)
    mine = sums(model)
    other = np.concatenate([s.reshape(-1) for s in mine]) * 3  # another rank: three times the totals
    carry = FitCarry({}, Ranks(0, [other]))
    logs = {"loss": -1.0, "mae": -1.0}
    carry.globalize(model, logs)
    flat = np.concatenate([s.reshape(-1) for s in sums(model)])
    assert np.allclose(flat, np.concatenate([s.reshape(-1) for s in mine]) * 4, rtol=1e-6, atol=0)
    assert logs["loss"] == pytest.approx(float(model.metrics[0].result()))  # total*4 / count*4: the job's mean
    carry.save(model, [], in_epoch=True)
    committed = carry.store["metrics"]
    for m in model.metrics:
        m.reset_state()
    carry.start_epoch(model, inside=True)  # rank 0: the job's sums so far
    assert all(np.allclose(s, np.asarray(c), rtol=1e-6, atol=0) for s, c in zip(sums(model), committed))
    assert len(committed) == len(sums(model)) and committed
    for m in model.metrics:
        m.reset_state()
    FitCarry(carry.store, Ranks(1, [])).start_epoch(model, inside=True)  # other ranks start from zero
    assert all(not s.any() for s in sums(model))


def test_the_callbacks_counters_come_back_after_a_new_call_reset_them(keras, fit_carry):
    FitCarry, carried = fit_carry.FitCarry, fit_carry.carried
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=3)
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=2)
    plateau.best, plateau.wait, plateau.cooldown_counter = 1.25, 2, 1
    stop.best, stop.wait, stop.stopped_epoch, stop.best_epoch = np.float32(0.5), 1, 0, 3
    carry = FitCarry({}, Ranks(0, []))
    model = trained_model(keras)
    carry.save(model, carried([plateau, stop]), in_epoch=False)
    assert carry.store["metrics"] == []
    plateau.on_train_begin()
    stop.set_model(model)
    stop.on_train_begin()
    assert (plateau.wait, stop.wait) == (0, 0)
    carry.restore_callbacks(carried([plateau, stop]))
    assert (plateau.best, plateau.wait, plateau.cooldown_counter) == (1.25, 2, 1)
    assert (stop.best, stop.wait, stop.best_epoch) == (0.5, 1, 3) and type(stop.best) is float


def test_early_stopping_that_restores_its_best_weights_is_refused_and_the_entry_name_is_checked(keras, fit_carry):
    FitCarry, carried = fit_carry.FitCarry, fit_carry.carried
    with pytest.raises(ConfigError, match="restore_best_weights=True"):
        carried([keras.callbacks.EarlyStopping(restore_best_weights=True)])

    class FakeState:
        objects = {fit_carry.CARRY_NAME: [1, 2]}
        binding = Ranks(0, [])

    with pytest.raises(StateError, match="rename that object"):
        FitCarry.attach(FakeState())
