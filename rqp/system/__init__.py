"""The operating system, behind small adapters: System V queues (:mod:`~rqp.system.queues`),
atomic files (:mod:`~rqp.system.files`), the control socket (:mod:`~rqp.system.control`),
pid files, locks and sd_notify (:mod:`~rqp.system.service`). No policy lives here."""
