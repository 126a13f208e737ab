"""The kvpool daemon: a single-threaded arbiter of a host's device pages (never imports torch).

One concept per file (docs/ARCHITECTURE.md, "Daemon layout"): the server side
(``server`` the loop and its timers, ``fdwatch`` its poller, ``startup``, ``control``,
``fdsessions``, ``fdsend``, ``fdqueue``, ``restart``) moves bytes and descriptors; the
arbiter side (``arbiter`` the dispatch table and the tick, over handlers that each take
the state they act on: ``registry``, ``grants``, ``adoption``, ``handoff``, ``locate``,
``views``, ``integrity``, ``reclaim``; and that state: ``pool``, ``tenants``,
``regions``, ``counters``, ``outcome``'s outbox) decides, free of sockets; one
arbiter per device (``devices``), tensor-parallel tenants across them (``gangs``).
``fairshare`` and ``escrow`` are pure policy. ``config`` is the one settings schema;
``auth`` who may do what; ``hooks`` the observation points,
``observe``/``measures``/``events``/``metrics`` what it decided; ``notify`` sd_notify.
"""
