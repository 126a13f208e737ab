"""The kvpool daemon: a single-threaded arbiter of one device's pages (never imports torch).

Files: ``config`` (one dataclass), ``pool`` (pages, warm pool, budget), ``regions``
(page tables), ``tenants`` (records), ``auth`` (who may do what), ``arbiter`` (request
handling), ``server`` (the event loop), ``notify`` (sd_notify).
"""
