#include "core/collective_identity.h"

#include <cstdio>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace shardkit::core {

namespace {

thread_local uint64_t current = 0;

// Never destroyed: a worker thread may still describe an identity (a failing op's message) while the process exits.
std::mutex& names_mutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}

std::unordered_map<uint64_t, std::string>& names() {
  static auto* table = new std::unordered_map<uint64_t, std::string>;
  return *table;
}

// FNV-1a, 64 bits: the same on every platform and process (std::hash promises neither).
uint64_t fnv1a(const std::string& text) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

}  // namespace

uint64_t identity_of(const std::string& description, const std::string& detail) {
  uint64_t identity = fnv1a(description + '\0' + detail);
  if (identity == 0) identity = 1;
  std::lock_guard<std::mutex> lock(names_mutex());
  names().emplace(identity, description);
  return identity;
}

std::string describe_identity(uint64_t identity) {
  if (identity == 0) return "no part";
  {
    std::lock_guard<std::mutex> lock(names_mutex());
    if (auto found = names().find(identity); found != names().end()) return found->second;
  }
  char hex[40];
  std::snprintf(hex, sizeof(hex), "0x%016llx", static_cast<unsigned long long>(identity));
  return std::string("an unknown part (identity ") + hex + ")";
}

IdentityScope::IdentityScope(uint64_t identity) : outer_(current) { current = identity; }

IdentityScope::~IdentityScope() { current = outer_; }

uint64_t current_identity() { return current; }

uint64_t exchange_current_identity(uint64_t identity) { return std::exchange(current, identity); }

}  // namespace shardkit::core
