"""The kvpool daemon: a single-threaded arbiter of one device's pages (never imports torch).

One concept per file (docs/ARCHITECTURE.md, "Daemon layout"): the server side
(``server`` the loop, ``timers``, ``startup``, ``control``, ``fdsessions``, ``fdsend``,
``fdqueue``, ``restart``) moves bytes and descriptors; the arbiter side (``arbiter`` the
state and dispatch table, ``registry``, ``grants``, ``adoption``, ``views``,
``integrity``, ``reclaim``, ``fairshare``, ``pool``, ``tenants``, ``regions``) decides,
free of sockets. ``config`` is the one settings schema; ``auth`` who may do what;
``observe``/``measures``/``events``/``metrics`` what it decided; ``notify`` sd_notify.
"""
