//! The simulated host of `keel-agentd --simulate` (filled by the agent issue).
