"""What is not the runtime: ``rqpctl`` (:mod:`~rqp.tools.ctl`), the replay of dead letters
(:mod:`~rqp.tools.replay`), the demo (:mod:`~rqp.tools.demo`) and the benchmarks
(:mod:`~rqp.tools.bench`, :mod:`~rqp.tools.report_bench`). Nothing in the runtime imports
this package."""
