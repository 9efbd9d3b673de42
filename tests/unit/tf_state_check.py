"""Run by test_tf_state.py in a fresh process per Keras version (the version
is fixed at TensorFlow's import): exact restore for every TF adapter."""

import os
import sys

legacy = sys.argv[1] == "2"
if legacy:
    os.environ["TF_USE_LEGACY_KERAS"] = "1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if legacy:
    import tf_keras as keras  # noqa: E402
else:
    import keras  # noqa: E402

from elastic_ext.state.adapters import adapter_table  # noqa: E402
from elastic_ext.errors import StateError  # noqa: E402
from elastic_ext.state.snapshot import Entry  # noqa: E402
from elastic_ext.testing import SoloBinding, state_on  # noqa: E402

assert keras.__version__.startswith(sys.argv[1]), keras.__version__
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="relu"),
                          keras.layers.BatchNormalization(), keras.layers.Dense(2)])
optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.1)


class Counter(tf.Module):
    def __init__(self):
        super().__init__()
        self.count = tf.Variable(0, dtype=tf.int64)
        self.scale = tf.Variable([1.0, 2.0])


module = Counter()
variable = tf.Variable([[1.0, 2.0], [3.0, 4.0]])
var_list = [tf.Variable(1.5), tf.Variable([7, 8], dtype=tf.int32)]
state = state_on(SoloBinding(), model=model, optimizer=optimizer, module=module, variable=variable,
              var_list=var_list, step=0)
# Which adapter takes each object: the first of the table that handles it.
table = adapter_table()
names = {name: next(a for a in table if a.handles(obj)).name for name, obj in state.objects.items()}
assert names == {"model": "tf.model", "optimizer": "tf.optimizer", "module": "tf.model",
                 "variable": "tf.variable", "var_list": "tf.variables", "step": "plain"}, names
tf_adapters = {adapter.name: adapter for adapter in table}


def values(obj):
    variables = obj.variables() if callable(getattr(obj, "variables", None)) else obj.variables
    return [np.array(v.numpy()) for v in variables]


def train(steps):
    for _ in range(steps):
        x = tf.random.normal((6, 8))
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x, training=True) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    module.count.assign_add(steps)
    module.scale.assign(module.scale * 2)
    variable.assign(variable + 1)
    var_list[0].assign(var_list[0] * 3)
    var_list[1].assign([0, 0])


def snapshot():
    return ([values(model), values(optimizer), values(module)], variable.numpy().copy(),
            [v.numpy().copy() for v in var_list])


def same(a, b):
    (objs_a, var_a, list_a), (objs_b, var_b, list_b) = a, b
    for xs, ys in zip(objs_a, objs_b):
        assert len(xs) == len(ys) and all(x.tobytes() == y.tobytes() for x, y in zip(xs, ys))
    assert var_a.tobytes() == var_b.tobytes()
    assert all(x.tobytes() == y.tobytes() for x, y in zip(list_a, list_b))


train(2)
state.step = 2
state.commit()
committed = snapshot()
train(3)
state.step = 5
state.restore()
same(snapshot(), committed)
assert state.step == 2
# Training on from the restored state is identical to training on from the commit.
tf.random.set_seed(7)
train(2)
after = snapshot()
state.restore()
tf.random.set_seed(7)
train(2)
same(snapshot(), after)
# A model built differently is an error that says so, not silent garbage.
def committed_entry(adapter, obj):
    capture = adapter.capture(obj)
    arrays = {}
    for key, source in capture.arrays.items():
        arrays[key] = np.empty(source.shape, dtype=source.dtype)
        source.copy_into(arrays[key])
    return Entry(arrays=arrays, meta=capture.meta)


other = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
try:
    tf_adapters["tf.model"].apply(other, committed_entry(tf_adapters["tf.model"], model))
except StateError as exc:
    assert "variables" in str(exc) or "shape" in str(exc), exc
else:
    raise AssertionError("restoring into a different model did not fail")
# BatchNormalization's moving statistics (non-trainable) may differ between
# ranks; the trainable variables may not.
from elastic_ext.tensorflow.adapters import _apply_variables, _capture_variables  # noqa: E402

buffers = tf_adapters["tf.model"].buffer_keys(model)
expected = {f"{i:05d}" for i, v in enumerate(model.variables) if not v.trainable}
assert buffers == expected and len(buffers) >= 2, (buffers, [v.name for v in model.variables])
assert not any(model.variables[int(k)].trainable for k in buffers)
names = [getattr(model.variables[int(k)], "path", None) or model.variables[int(k)].name for k in sorted(buffers)]
assert any("moving_mean" in n for n in names) and any("moving_variance" in n for n in names), names
# Only a model's non-trainable variables are buffers: a lone non-trainable
# variable, a variable list and an optimizer's slots must agree across ranks.
frozen = tf.Variable(1.0, trainable=False)
assert tf_adapters["tf.variable"].buffer_keys(frozen) == frozenset()
assert tf_adapters["tf.variables"].buffer_keys([frozen]) == frozenset()
assert tf_adapters["tf.optimizer"].buffer_keys(optimizer) == frozenset()


# Past 100,000 variables the keys ("99999", "100000") no longer sort as text
# in variable order; the restore must still put every value back in its own
# variable. Stand-ins with shape and assign() keep this to a second.
class Slot:
    shape, dtype = (), np.dtype(np.float64)

    def __init__(self, index):
        self.index, self.value = index, None
        self.name = f"v{index}"

    def numpy(self):
        return np.float64(self.index)

    def assign(self, value):
        self.value = value


COUNT = 100_002
slots = [Slot(i) for i in range(COUNT)]
capture = _capture_variables(slots, None)
committed = {}
for key, source in capture.arrays.items():
    buffer = np.empty(source.shape, dtype=np.float64)
    source.copy_into(buffer)
    committed[key] = buffer
assert sorted(committed)[10_001] == "100000"  # text order is not variable order here
entry = Entry(arrays=committed, meta=None)
_apply_variables(slots, entry, "100k variables")
wrong = [s.index for s in slots if float(s.value) != s.index]
assert not wrong, f"{len(wrong)} variables restored from another variable's value, first {wrong[:3]}"
print("ok", len(values(optimizer)))
