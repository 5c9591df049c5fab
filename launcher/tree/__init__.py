"""Fan-out through the hosts (`dtrain launch --fanout K`): relays start the agents below them.

    shape     which host starts which: a K-ary tree in host order, the --fanout default (pure)
    fence     one relay's PMI fence: its subtree's barriers merged into one message, cards
              kept for the gets from below (pure)
    hops      what the head hands a relay per host: the address, user, key paths and the
              known_hosts lines it verified with; the relay's private known_hosts file
    relay     the agent's relay: connects its children, routes frames both ways (adapter)
    upstream  a relay's children's streams read, their frames taken or sent up (adapter)
    head      the head's side: one real stream per host it starts, a RelayedStream per host
              below it, so the rest of the launch sees one stream per host (adapter)

The frames: SUBTREE (head -> relay, first), ROUTED (a host's frames, by index, both ways),
GONE (relay -> head: a host's stream ended). docs/design.md, "Fan-out".
"""
