// Collective identity: which part of a model a collective moves — an FSDP unit's parameters, a DDP bucket — so that
// ranks whose collectives pair up by number, kind and size but belong to different parts fail instead of mixing
// one part's data into another's (the same shapes in two heads, a unit one rank skipped).
//
// A caller that issues collectives for a part names it for the collectives it issues from this thread
// (IdentityScope) — only around code whose collectives are the same on every rank: not around a call that may run
// a future's callbacks inline on one rank and leave them to another thread on another (a DDP comm hook). The
// backend reads current_identity() when it launches an op and carries it in the op's header, which every rank
// compares at every sync (core::OpHeader::identity: no extra traffic). An identity is a 64-bit
// hash of the part's description, so it is the same on every rank that built the same model; each process
// remembers the descriptions it hashed, so a message can say what a peer's identity stands for.
#pragma once

#include <cstdint>
#include <string>

namespace shardkit::core {

// The identity of the part `description` describes ("FSDP unit 'blocks.3' (...)"), hashed with `detail` (what
// tells parts apart that messages need not spell out: the parameters' shapes, say): never 0 (0 is "none").
uint64_t identity_of(const std::string& description, const std::string& detail = "");
// "FSDP unit 'blocks.3' (...)" for an identity this process made; "an unknown part (identity 0x...)" otherwise;
// "no part" for 0.
std::string describe_identity(uint64_t identity);

// The identity of the collectives this thread issues from construction to destruction (scopes nest).
class IdentityScope {
 public:
  explicit IdentityScope(uint64_t identity);
  ~IdentityScope();
  IdentityScope(const IdentityScope&) = delete;
  IdentityScope& operator=(const IdentityScope&) = delete;

 private:
  uint64_t outer_;
};

// The innermost IdentityScope's identity on this thread; 0 outside any.
uint64_t current_identity();
// Makes `identity` this thread's current one and returns the one it replaces (for scopes kept by a caller in another
// language: python/shardkit/_collective_identity.py restores them in order).
uint64_t exchange_current_identity(uint64_t identity);

}  // namespace shardkit::core
