"""The elastic bundled server, ``kvpool serve MODEL --elastic``: the plain server's routes
over an engine whose KV (and weights) live in kvpool (:mod:`.app`), with sleep and wake
routes (:mod:`.sleep_routes`), warm restart (a retiring engine that hands its cache and
requests to a successor: :mod:`.warm_engine`, :mod:`.warm_relay`, :mod:`.warm_commands`,
:mod:`.locate`), prefill/decode pairs (:mod:`.pd`), and who may use the control routes
(:mod:`.control_auth`, :mod:`.retire_auth`, :mod:`.relay_auth`).

Above the adapter (:mod:`kvpool.engine_adapters.bundled`), never below it: the adapter
does not import this package."""
