"""TensorFlow support: adapters for tf.Variable, tf.Module and Keras 2 (tf_keras)
and Keras 3 models and optimizers, the Horovod binding, and a ``tf.data``
source driven by the elastic cursor.

The only package of elastic_ext that imports tensorflow.
"""

from elastic_ext.tensorflow.data import ElasticSampler, index_dataset

__all__ = ["ElasticSampler", "index_dataset"]
