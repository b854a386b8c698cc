"""What sits on top of the library: the ``fsharded`` command and training app, and the tools.

==================  ====================================================================
module              what
==================  ====================================================================
``cli``             the ``fsharded`` command (``python -m fsharded``): train, bench, ...
``train``           the GPT training app (``python -m fsharded.train``, ``fsharded train``)
``data``            token sources and resumable batches (``fs.data``)
``memory``          the memory tracker's public face (``fs.memory``)
``timeline``        measured collectives and phases of a step on real ranks (``fs.timeline``)
``visualize``       ``visualize_sharding`` (``fs.visualize_sharding``)
``plot``            matplotlib figures of metrics, memory and collectives
``flops``           model FLOPs of a step, and measured FLOPs
``demo``            a runnable tour of the SPMD core (``python -m fsharded.demo``)
==================  ====================================================================

Each module keeps its old name too: ``fsharded.memory`` is ``fsharded.tools.memory`` (the
same module object), and so on. Benchmarks are ``fsharded.bench``. Importing this package
imports none of its modules.
"""
