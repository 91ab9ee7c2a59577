/*
 * replay_comm.c — the communication lanes of a replay (docs/sim-model.md,
 * "Collectives"): the trace's collectives (FSDP's all-gathers and
 * reduce-scatters, tensor parallelism's all-reduces) run on a lane per
 * group, in issue order, concurrently with compute; a collective_wait makes
 * the compute stream wait for one (the exposed part).
 *
 * A collective moves bytes x (ranks - 1) / ranks per rank (all-reduce: twice
 * that; NCCL's bus-bandwidth factors) at its lane's bus bandwidth: NVLink
 * within a node; the GPU's NIC when the data-parallel group spans nodes.
 * NIC traffic crosses the GPU's PCIe link (GPUDirect RDMA through the PCIe
 * switch) in both directions, so while such a collective runs it is one
 * more flow on each direction of the link the offload copies use: the copies
 * share the link with it (sim_backend_share_link) and it gets at most its
 * share, the NIC's rate or less.
 *
 * Time moves in pieces: the clock advances to the next collective's end or
 * the end of the compute, whichever is first, each lane's rate constant over
 * a piece (re-evaluated at every trace event and collective end: a copy that
 * starts or ends inside a piece changes the copies' rates at once, the
 * collective's at the piece's end).
 */

#include "sim/replay_internal.h"

#define COMM_EPS_BYTES 1e-3

/* Bytes per rank on the wire (NCCL's busbw factor times the buffer). */
static double wire_bytes(const trace_collective *c) {
  double f = (double)(c->ranks - 1) / (double)c->ranks;
  return (double)c->bytes * f * (c->kind == SIM_COLL_ALL_REDUCE ? 2 : 1);
}

/* Whether lane g goes through the NIC (and so the PCIe link). */
static int lane_inter(const replay *r, int g) {
  return g == SIM_GROUP_SHARD && r->c->comm_nodes > 1;
}

/* Whether lane g shares the PCIe link: through a NIC that is timed. */
static int lane_on_pcie(const replay *r, int g) {
  return lane_inter(r, g) && r->c->nic_bytes_per_s > 0;
}

int comm_open(replay *r) {
  const sim_trace *t = r->t;
  if (!t->n_collectives || !r->sim) return 0;
  /* a group spans at most one node per rank: more is a mistaken --nodes */
  for (uint32_t i = 0; r->c->comm_nodes > 1 && i < t->n_collectives; i++) {
    const trace_collective *c = &t->collectives[i];
    if (c->group == SIM_GROUP_SHARD && (uint32_t)c->ranks < r->c->comm_nodes)
      return ferry_errbuf(r->err, r->errlen, FERRY_EINVAL,
                          "the data-parallel group spans %u nodes (--nodes) but has %d ranks "
                          "(trace line %u): at most one node per rank",
                          r->c->comm_nodes, (int)c->ranks, c->line);
  }
  comm_model *m = calloc(1, sizeof *m);
  if (!m || !(m->done = malloc(t->n_collectives * sizeof *m->done))) {
    free(m);
    return ferry_errbuf(r->err, r->errlen, FERRY_ENOMEM, "out of memory");
  }
  for (int g = 0; g < 2; g++) {
    if (!(m->lane[g].q = malloc(t->n_collectives * sizeof *m->lane[g].q))) {
      r->comm = m;
      comm_close(r);
      return ferry_errbuf(r->err, r->errlen, FERRY_ENOMEM, "out of memory");
    }
  }
  m->t = replay_now(r);
  r->comm = m;
  return 0;
}

void comm_close(replay *r) {
  comm_model *m = r->comm;
  if (!m) return;
  for (int g = 0; g < 2; g++) free(m->lane[g].q);
  free(m->done);
  free(m);
  r->comm = NULL;
}

/* Lane g's rate for its head collective, bytes/µs (0: unlimited), and the
 * link sharing set for the piece to come. Across nodes NCCL runs a ring per
 * NIC, each leaving a node through its own NIC: the group's GPUs on a node
 * (ranks / nodes) carry a collective with their NICs together, each NIC an
 * equal part through its own GPU's PCIe link, and the rings' hops within
 * the node keep NVLink's bound. */
static double lane_rate(replay *r, int g, const unsigned active[2]) {
  const sim_config *c = r->c;
  if (!lane_inter(r, g)) return c->nvlink_bytes_per_s / 1e6;
  if (!lane_on_pcie(r, g)) return 0; /* an untimed NIC */
  const comm_lane *l = &r->comm->lane[g];
  const double per_node = (double)r->t->collectives[l->q[l->head]].ranks / (double)c->comm_nodes;
  const double gpus = per_node > 1 ? per_node : 1;
  double rate = c->nic_bytes_per_s / 1e6;
  /* each GPU's NIC flow takes its share of each PCIe direction, both busy */
  const double pcie[2] = {c->link.d2h_bytes_per_s, c->link.h2d_bytes_per_s};
  const double dup[2] = {c->duplex_d2h > 0 ? c->duplex_d2h : c->link.duplex,
                         c->duplex_h2d > 0 ? c->duplex_h2d : c->link.duplex};
  for (int d = 0; d < 2; d++) {
    if (!(pcie[d] > 0)) continue; /* an unlimited link takes nothing */
    double share = pcie[d] * dup[d] / (double)(active[d] + 1) / 1e6;
    if (share < rate) rate = share;
  }
  rate *= gpus;
  if (c->nvlink_bytes_per_s > 0 && c->nvlink_bytes_per_s / 1e6 < rate) rate = c->nvlink_bytes_per_s / 1e6;
  return rate;
}

/* The data-parallel lane's queued work, µs at its present rate: when its
 * NIC traffic ends if nothing changes the sharing meanwhile. */
static double lane_time_left(replay *r, const unsigned active[2]) {
  const comm_lane *l = &r->comm->lane[SIM_GROUP_SHARD];
  double rate = lane_rate(r, SIM_GROUP_SHARD, active), bytes = l->left;
  for (uint32_t k = 1; k < l->n; k++) bytes += wire_bytes(&r->t->collectives[l->q[l->head + k]]);
  return rate > 0 ? bytes / rate : 0;
}

/* Runs the lanes from their time to `until`; move_clock: the compute runs
 * meanwhile (the clock advances with them), else the clock is there already
 * (a wait inside the engine moved it) and only the lanes catch up;
 * to_an_end: stop when a collective ends. */
static void comm_run(replay *r, double until, int move_clock, int to_an_end) {
  comm_model *m = r->comm;
  const sim_trace *t = r->t;
  for (;;) {
    double left = to_an_end ? INFINITY : until - m->t;
    int inter_busy = m->lane[SIM_GROUP_SHARD].n && lane_on_pcie(r, SIM_GROUP_SHARD);
    unsigned active[2] = {0, 0};
    sim_backend_share_link(r->sim, inter_busy ? 1 : 0, INFINITY, active);
    if (inter_busy) /* a wait inside the engine may outlast the lane's work */
      sim_backend_share_link(r->sim, 1, m->t + lane_time_left(r, active), NULL);
    if (!(left > 1e-9) || (to_an_end && !m->lane[0].n && !m->lane[1].n)) break;
    double rate[2] = {0, 0}, piece = left;
    for (int g = 0; g < 2; g++) {
      comm_lane *l = &m->lane[g];
      if (!l->n) continue;
      rate[g] = lane_rate(r, g, active);
      if (!(rate[g] > 0)) {
        piece = 0; /* unlimited: ends at once */
        continue;
      }
      double dt = l->left / rate[g];
      if (dt < piece) piece = dt;
    }
    if (move_clock && piece > 0) replay_compute(r, piece);
    m->t += piece;
    int ended = 0;
    for (int g = 0; g < 2; g++) {
      comm_lane *l = &m->lane[g];
      if (!l->n) continue;
      m->busy_us += piece;
      l->left = rate[g] > 0 ? l->left - rate[g] * piece : 0;
      /* done when what is left is below a byte's worth of time, or the end
       * is within the clock's resolution */
      if (l->left > COMM_EPS_BYTES && m->t + l->left / rate[g] > m->t * (1 + 1e-15)) continue;
      m->done[l->q[l->head]] = m->t; /* done; the next one starts now */
      l->head++;
      l->n--;
      if (l->n) l->left = wire_bytes(&t->collectives[l->q[l->head]]);
      ended = 1;
    }
    if (to_an_end && ended) return;
  }
  if (!to_an_end && m->t < until) m->t = until;
}

/* Catches the lanes up to the clock (waits inside the engine moved it). */
static void comm_sync(replay *r) {
  double now = replay_now(r);
  if (now > r->comm->t) comm_run(r, now, 0, 0);
}

void comm_compute(replay *r, double us) {
  if (!r->comm) {
    replay_compute(r, us);
    return;
  }
  comm_sync(r);
  comm_run(r, r->comm->t + (us > 0 ? us : 0), 1, 0);
}

void comm_issue(replay *r, uint32_t idx) {
  comm_model *m = r->comm;
  if (!m) return;
  comm_sync(r);
  const trace_collective *c = &r->t->collectives[idx];
  comm_lane *l = &m->lane[c->group];
  if (l->head + l->n >= r->t->n_collectives) { /* compact: a step's worth at most */
    memmove(l->q, l->q + l->head, l->n * sizeof *l->q);
    l->head = 0;
  }
  m->done[idx] = -1;
  if (!l->n) l->left = wire_bytes(c);
  l->q[l->head + l->n++] = idx;
  m->count++;
  m->bytes += wire_bytes(c);
  comm_run(r, m->t, 0, 0); /* sets the link sharing for what now runs */
}

/* The compute stream waits for collective idx: the clock stands still
 * for compute while the lanes (and copies) run on. */
void comm_wait(replay *r, uint32_t idx) {
  comm_model *m = r->comm;
  if (!m) return;
  comm_sync(r);
  double before = replay_now(r);
  while (m->done[idx] < 0) {
    const comm_lane *l = &m->lane[r->t->collectives[idx].group];
    if (!l->n) break; /* never issued this step: nothing to wait for */
    comm_run(r, 0, 1, 1); /* to the next end */
  }
  m->exposed_us += replay_now(r) - before;
}

/* The step ends: the optimizer needs every reduce-scattered gradient, so
 * what is still in flight is waited for. */
void comm_drain(replay *r) {
  comm_model *m = r->comm;
  if (!m) return;
  comm_sync(r);
  double before = replay_now(r);
  for (int g = 0; g < 2; g++) {
    comm_lane *l = &m->lane[g];
    while (l->n) comm_run(r, 0, 1, 1);
  }
  m->exposed_us += replay_now(r) - before;
}
