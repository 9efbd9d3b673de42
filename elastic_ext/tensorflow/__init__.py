"""TensorFlow support: adapters for tf.Variable, tf.Module and Keras 2 (tf_keras)
and Keras 3 models and optimizers, the Horovod binding, a ``tf.data``
source driven by the elastic cursor, Horovod's gradient API for Keras 2 and
Keras 3 variables, and the callback that makes ``model.fit`` elastic.

The only package of elastic_ext that imports tensorflow. Importing it
registers its adapters with the core (:mod:`elastic_ext.state.adapters`), which
loads this package by itself once TensorFlow or Keras is imported.
"""

from elastic_ext.state import adapters as _core
from elastic_ext.tensorflow import adapters as _adapters
from elastic_ext.tensorflow.callbacks import ElasticCallback, FitStep
from elastic_ext.tensorflow.data import ElasticSampler, index_dataset
from elastic_ext.tensorflow.tape import DistributedGradientTape
from elastic_ext.tensorflow.optimizer import DistributedOptimizer

_core.register_adapters("tensorflow", _adapters.adapters)

__all__ = ["ElasticSampler", "index_dataset", "DistributedGradientTape", "DistributedOptimizer",
           "ElasticCallback", "FitStep"]
