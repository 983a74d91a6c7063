"""Lazy restore: containers start before their memory is read; pages come from the store on demand.

The steps, in the order a lazy restore takes them (docs/lazy-restore.md),
and the module that does each:

1. Pull lazily (optional, across nodes): `remote` picks the chunks only the
   memory images use; the registry pull (`registry.pulling`) leaves those in
   the registry and the store records where they still live (the
   checkpoint's origin). `transfers` keeps the password for that registry
   in memory, for the chunks fetched later.
2. Decide: `support` says whether CRIU and the kernel can restore lazily
   (`node-agent doctor` prints the same verdict); `restores.LazyRestores`
   says whether this restore goes lazily (its `lazy` option, the node's
   `lazy-restore` setting, no pre-dumped memory), and `filled` whether a
   full one goes through the page source all the same, its processes held
   until every page is in (`criu_bridge.resumegate`).
3. Stage: `staging` reads each task's pagemap (`pagemap`) and writes the
   pages files sparse, with only the pages that cannot come lazily; the
   restorer (`restoring`) materializes the rest and writes the plan.
4. Fetch ahead: from the restore's start (for a Pod, once RunPodSandbox has
   made the sandbox) until it connects, `prefetch` brings what a lazy pull
   left in the registry into the store, in the order the restore reads it.
5. Start the helpers, per container, before StartContainer:
   `restores.LazyRestores.start` gives the page source its blobs (a store
   hold, or hard links to a caller's checkpoint) and the origin, and starts
   a `session.LazySession`: the page source process (`source`), waiting
   on the plan's lazy-pages socket.
6. Serve: StartContainer's `runc restore --lazy-pages` (`criu_bridge.wrapper`)
   hands the processes' userfaultfds to the page source, whose fault
   handler (`handler`, over the kernel interface in `uffd` and the books
   in `spans`) answers faults with whole windows of pages and streams the
   rest. The pages come from the chunks (`chunks`), read from the store or
   fetched from the origin (`registry.fetching`), verified and decoded.
   The source runs at the background priority (`background`).
7. Guard and end: the session holds duplicates of the userfaultfds while
   the container runs, kills the container (`kill`) on any failure, with the
   rest of its pod (`kill.stop_pod`, through the restorer's records,
   `node_agent.replicas`), and records the outcome in the plan; once a
   lazily pulled checkpoint's pages are all in, `restores` asks the store to
   settle its origin. A page source whose agent is gone does all of this
   itself. `restores.LazyRestores.report` says how each replica is doing.
8. After a crash: at start-up, `strays` ends the helpers a dead agent left
   that have no process to serve (`recovery`).
"""
