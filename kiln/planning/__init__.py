"""Planning: which library runs which part of the graph (regions), the whole-plan race, and the memory plan."""
