"""What the agents keep on disk: one append-only, CRC-checked, compacted log store
(:mod:`~rqp.storage.log`) with two users, the sending MCA's journal
(:mod:`~rqp.storage.journal`) and the receiving MCA's dedup window (:mod:`~rqp.storage.dedup`);
the dead-letter archive files (:mod:`~rqp.storage.archive`)."""
