"""The protocol, with no I/O: what RQP says and decides, never how bytes move.

* :mod:`~rqp.protocol.constants`: message codes, types, limits and the documented defaults;
* :mod:`~rqp.protocol.errors`: every project exception (each an :class:`RQPError`);
* :mod:`~rqp.protocol.reasons`: the one table of dead-letter reasons;
* :mod:`~rqp.protocol.keys`: the one queue-key validator;
* :mod:`~rqp.protocol.events`, :mod:`~rqp.protocol.frames`: the six frames, bytes <-> events;
* :mod:`~rqp.protocol.records`: the transmission and dead-letter records;
* :mod:`~rqp.protocol.sender`, :mod:`~rqp.protocol.receiver`: the two state machines.

Nothing here imports ``socket``, ``selectors``, ``asyncio`` or ``sysv_ipc``, nor any other
package of the project (``tests/test_layers.py`` checks it): the caller owns the I/O.
"""
