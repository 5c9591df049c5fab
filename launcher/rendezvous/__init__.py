"""Rendezvous mode: agents that something else starts (Kubernetes, a batch system, an instance
group) join the head over TCP, authenticated by a shared token; docs/design.md, "Rendezvous".

    options     the head's and the agent's settings, the token file (pure)
    tokens      the one accepted token form; `dtrain token new` writes one owner-only
    handshake   challenge and response over the token, both sides (pure)
    clear       handshake frames bounded before parsing; network text made printable (pure)
    channel     the sealed records everything after the handshake travels in (pure)
    roster      who joined, their order, who is refused; `vacate`: the restart hook (pure)
    strangers   connections that proved no token: counted, a few rate-limited lines (pure)
    stream      the handshake's frames, the sealed socket, the head's AgentStream (adapter)
    gate        every connection until it proved the token, in one thread (adapter)
    listener    the head's socket: the gate, JOINs, the lobby until the start (adapter)
    head        the transport table's `rendezvous` entry: wait for N agents, place them
    join        `dtrain agent --rendezvous`: reach the head, join, serve as its agent (adapter)
    command     the click options of `dtrain launch --rendezvous-port`, `dtrain agent` and
                `dtrain token new`
"""
