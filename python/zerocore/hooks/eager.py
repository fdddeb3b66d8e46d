"""torch.compile: the module hooks and the saved-tensor hooks are
torch.compiler.disable'd (FSDP2's are too): they call the native schedule
and rebind params, which dynamo must not trace. A compiled module's graphs
break at each unit's hooks, so a unit's forward is a graph of its own
(and its backward, through AOTAutograd), called with the params its
pre-hook bound; the params it saves for backward go through SavedParamViews
like any others. (A root forward that calls its units in a loop runs its own
code eagerly: dynamo gives up on a frame with a graph break in a loop.)
fullgraph=True across units cannot work and raises with UNIT_HOOKS as the
reason; the backward hooks run inside engine.backward, which is eager.
"""
import torch

# Why a graph breaks at a unit's hooks: dynamo's error under fullgraph=True.
UNIT_HOOKS = ("zerocore stage 3 gathers and releases a unit's params in its module hooks, which run eagerly: a "
              "graph breaks at each unit. Compile without fullgraph=True, or compile each unit with "
              "torch.compile(unit, fullgraph=True) before zerocore.wrap (its hooks then run outside the graph)")
eager = torch.compiler.disable(reason=UNIT_HOOKS)
