// ProcessGroupShardkit's set-up and teardown: the start-up (the host's shared-memory group, its engine, the CUDA
// route), its place in the process's abort cascade, abort and destroy_process_group(). The collectives are in
// backend.cpp.
#include "comm/backend.h"

#include <numeric>

#include "comm/abort_cascade.h"
#include "comm/hierarchical_engine.h"
#include "comm/shm_engine.h"
#ifdef SHARDKIT_WITH_CUDA
#include "comm/nccl/cuda_route.h"
#endif

namespace shardkit::comm {

namespace {

// How often the start-up asks the Store whether it failed elsewhere (a peer's pid on this host is looked at more
// often, by the shm group itself): a Store call costs a round trip to its host, per rank.
constexpr auto kStartupNoticeEvery = std::chrono::milliseconds(100);

}  // namespace

ProcessGroupShardkit::ProcessGroupShardkit(int rank, int size, const Config& config,
                                           c10::intrusive_ptr<c10d::Store> store,
                                           c10::intrusive_ptr<c10d::Store> job_store,
                                           c10::intrusive_ptr<c10d::Backend> fallback,
                                           c10::intrusive_ptr<c10d::Backend> inter_host)
    : c10d::Backend(rank, size),
      ranks_{config.global_ranks, config.pids},
      args_(ranks_.name(rank), size),
      config_(config),
      timeout_(config.timeout),
      inner_(std::make_shared<InnerBackends>(std::move(fallback), std::move(inter_host))) {
  TORCH_CHECK(config.num_hosts >= 1 && config.local_size >= 1 && config.local_rank < config.local_size,
              "shardkit (rank ", rank, "): invalid host topology: local rank ", config.local_rank, " of ",
              config.local_size, " on ", config.num_hosts, " host(s)");
  TORCH_CHECK(config.num_hosts == 1 || (static_cast<int>(config.host_of.size()) == size &&
                                        static_cast<int>(config.local_of.size()) == size),
              "shardkit (rank ", rank, "): host maps must have one entry per rank");
  TORCH_CHECK(config.global_ranks.empty() || static_cast<int>(config.global_ranks.size()) == size,
              "shardkit (rank ", rank, "): global_ranks must have one entry per rank, got ", config.global_ranks.size());
  TORCH_CHECK(config.pids.empty() || static_cast<int>(config.pids.size()) == size,
              "shardkit (rank ", rank, "): pids must have one entry per rank, got ", config.pids.size());
  core::PeerNames named_ranks{{}, config.pids};
  for (int r = 0; r < size; ++r) named_ranks.names.push_back(ranks_.name(r));
  // An isolated group records deaths in its own Store only (Config::isolated).
  notices_ = std::make_shared<FailureNotices>(store, config.isolated ? nullptr : std::move(job_store), rank,
                                              named_ranks,
                                              config.num_hosts > 1 ? config.host_of : std::vector<int>{});
  HostLayout layout{config.host_of, config.local_of};
  // This host's ranks, in local order (all ranks on one host).
  std::vector<int> local_members(size);
  std::iota(local_members.begin(), local_members.end(), 0);
  if (config.num_hosts > 1) local_members = layout.ranks_of(config.host_index);
  core::ShmGroup::Options options;
  options.name = config.shm_name;
  options.rank = config.local_rank;
  options.size = config.local_size;
  options.slot_bytes = config.slot_bytes;
  options.processes_on_machine = config.processes_on_machine;
  options.timeout = config.timeout;
  for (int r : local_members) {
    options.rank_names.push_back(ranks_.name(r));
    if (!config.pids.empty()) options.pids.push_back(config.pids[r]);
  }
  options.abandoned = [notices = notices_, me = "shardkit start-up (rank " + std::to_string(ranks_.name(rank)) + ")",
                       next = std::chrono::steady_clock::time_point()]() mutable {
    if (std::chrono::steady_clock::now() < next) return std::string();
    next = std::chrono::steady_clock::now() + kStartupNoticeEvery;
    const std::optional<std::string> cause = notices->root_cause();
    return cause ? me + ": the group's start-up failed: " + *cause : std::string();
  };
  std::unique_ptr<core::ShmGroup> local;
  try {
    local = std::make_unique<core::ShmGroup>(options);
  } catch (const std::exception& error) {
    TORCH_CHECK(false, error.what());
  }
  if (config.num_hosts == 1) {
    engine_ = std::make_shared<ShmEngine>(std::move(local));
  } else {
    TORCH_CHECK((config.local_rank != 0 && !config.rails) || inner_->has_inter_host(), "shardkit (rank ", rank,
                "): ", config.rails ? "with rails every rank" : "a host leader", " needs the inter-host backend");
    engine_ = std::make_shared<HierarchicalEngine>(rank, size, std::move(layout), config.rails, std::move(local),
                                                   inner_, notices_);
  }
#ifdef SHARDKIT_WITH_CUDA
  cuda_ = std::make_shared<CudaRoute>(rank, size, *engine_);
#endif
  LocalPointToPoint::Options p2p;
  p2p.rank = rank;
  p2p.names = named_ranks;
  for (int r = 0; r < size; ++r) {
    p2p.on_this_host.push_back(config.num_hosts == 1 || config.host_of[r] == config.host_index);
  }
  p2p.direct_bytes = config.p2p_direct_bytes;
  p2p.direct_read = config.p2p_direct_read;
  p2p.timeout = config.timeout;
  local_p2p_ = std::make_shared<LocalPointToPoint>(std::move(p2p), inner_, point_to_point_);
  // The flight recorder (trace.h): described at dump time, while the registry holds it (the destructor leaves the
  // registry first, so a dump never reaches a destroyed group).
  trace_ = std::make_shared<TraceRing>(trace_capacity(), [this] {
    TraceRing::Group group;
    group.name = getGroupUid().empty() ? "shardkit" : getGroupUid();
    group.description = getGroupDesc().empty() ? "undefined" : getGroupDesc();
    for (int r = 0; r < getSize(); ++r) group.ranks.push_back(ranks_.name(r));
    group.rank = getRank();
    group.global_rank = ranks_.name(getRank());
    return group;
  });
  // Last: a constructor that throws leaves nothing registered.
  if (trace_->capacity() > 0) {
    TraceRegistry::add(trace_);
    TraceRegistry::install_signal_handler();
  }
  if (!config.isolated) {  // an isolated group's failures stay its own (Config::isolated); token 0 joins nothing
    cascade_token_ = AbortCascade::join([routes = routes()](const std::string& reason) { routes.abort(reason); });
  }
}

ProcessGroupShardkit::Routes ProcessGroupShardkit::routes() const {
#ifdef SHARDKIT_WITH_CUDA
  return Routes{engine_, cuda_};
#else
  return Routes{engine_};
#endif
}

void ProcessGroupShardkit::Routes::abort(const std::string& reason) const {
  if (auto engine = host.lock()) engine->abort(reason);
#ifdef SHARDKIT_WITH_CUDA
  if (auto route = cuda.lock()) route->abort(reason);
#endif
}

void ProcessGroupShardkit::abort_with(const std::string& reason) {
  routes().abort(reason);
  // Sends and receives go to the inner gloo backend, outside the routes: abort those still waiting (gloo's abort
  // wakes a blocked wait, which then returns false). Copied out of the lock: an abort may take a moment.
  local_p2p_->abort();
  for (const auto& work : point_to_point_->take_waiting()) work->abort();
}

void ProcessGroupShardkit::abort() {
  abort_with("shardkit (rank " + std::to_string(ranks_.name(getRank())) + "): the process group was aborted");
}

std::optional<std::string> ProcessGroupShardkit::first_failure() const {
  std::lock_guard<std::mutex> lock(failure_mutex_);
  return first_failure_;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShardkit::track_point_to_point(c10::intrusive_ptr<c10d::Work> work) {
  point_to_point_->add(work);
  return work;
}

ProcessGroupShardkit::~ProcessGroupShardkit() {
  TraceRegistry::remove(trace_.get());
  AbortCascade::leave(cascade_token_);
}

void ProcessGroupShardkit::shutdown() {
  if (shut_down_.exchange(true)) return;  // destroy_process_group(), then the exit hook (backend.py)
  AbortCascade::leave(cascade_token_);
  queue_.stop();
#ifdef SHARDKIT_WITH_CUDA
  cuda_->shutdown();
#endif
  engine_->shutdown();
  local_p2p_->shutdown();
  inner_->shutdown();
}

OpContext ProcessGroupShardkit::context(const char* op, std::chrono::milliseconds timeout, uint64_t identity,
                                        bool compare_across_hosts, core::InterHostQuantization quantization) {
  return OpContext{op,       ++executed_,          timeout,      getRank(), ranks_.name(getRank()),
                   identity, compare_across_hosts, quantization, std::chrono::steady_clock::now()};
}

std::chrono::milliseconds ProcessGroupShardkit::op_timeout(std::chrono::milliseconds requested) const {
  return requested == c10d::kUnsetTimeout ? timeout_ : requested;
}

Engine& ProcessGroupShardkit::route(const OpContext&) { return *engine_; }

std::string ProcessGroupShardkit::cuda_route() const {
#ifdef SHARDKIT_WITH_CUDA
  return cuda_->describe();
#else
  return "none: this shardkit build drives CPU tensors only";
#endif
}

}  // namespace shardkit::comm
