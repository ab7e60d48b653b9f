// The object model for Python pickles: what ucp's unpickler builds and its pickler writes.
//
// A pickle is a program for a stack machine; ucp never runs what it names. Every value the
// program builds becomes one `Value` node owned by a `Graph`. Classes and functions stay names
// (kGlobal), objects built by calling or instantiating them stay records of that call (kObject),
// and persistent ids stay the pid value they carry (kPersistentId). Identity is preserved: an
// object the pickle references twice through its memo is one node reached twice, so
// `a is b` survives a read → write round trip, and so do recursive structures.
//
// How each Python construct maps to a node:
//   None, True/False          kNone, kBool
//   int                       kInt: an int64 when it fits, else the minimal little-endian
//                             two's-complement bytes (the LONG1/LONG4 payload)
//   float                     kFloat (IEEE double; nan, inf and -0.0 kept bit-exact)
//   str                       kStr: UTF-8 bytes; lone surrogates are kept as Python's
//                             'surrogatepass' writes them (ED A0 80 ...)
//   bytes, bytearray          kBytes, kByteArray: raw bytes
//   tuple/list/set/frozenset  kTuple/kList/kSet/kFrozenSet: ordered element pointers (a set's
//                             elements in pickle order)
//   dict                      kDict: ordered (key, value) pairs, keys of any kind, duplicates
//                             kept as written
//   GLOBAL / STACK_GLOBAL     kGlobal(module, name), names exactly as the pickle spells them
//                             (no Python 2 ↔ 3 renaming)
//   REDUCE / NEWOBJ /         kObject: how it was built (Construction), the callable or class,
//   NEWOBJ_EX / INST / OBJ    the argument tuple, kwargs for NEWOBJ_EX; then, in pickle order,
//                             the mutations applied to it afterwards: APPEND(S) items,
//                             SETITEM(S) pairs and BUILD states (e.g. an OrderedDict is
//                             REDUCE(collections.OrderedDict, ()) + SETITEM mutations; a
//                             dataclass is NEWOBJ(cls, ()) + one BUILD mutation)
//   PERSID / BINPERSID        kPersistentId(pid): torch's storages are
//                             pid = ('storage', Global torch.FloatStorage, '0', 'cpu', numel)
//   EXT1 / EXT2 / EXT4        kExtension(code): a copyreg extension-registry code, unresolved
//
// Thread-safety: a Graph and its Values are plain data: concurrent const access is safe, any
// mutation needs external synchronisation. Nodes of one Graph must never be linked into another.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/util/status.h"

namespace ucp::pickle {

// Deepest nesting any recursive walk (Render, the pickler) follows before failing with
// kOutOfRange; the unpickler refuses to build deeper containers. Python's own pickler stops at
// its recursion limit (1000 by default), so no pickle Python wrote is deeper.
inline constexpr uint32_t kMaxDepth = 1000;

enum class Kind : uint8_t {
  kNone,
  kBool,
  kInt,
  kFloat,
  kStr,
  kBytes,
  kByteArray,
  kTuple,
  kList,
  kDict,
  kSet,
  kFrozenSet,
  kGlobal,
  kObject,
  kPersistentId,
  kExtension,
};

// "None", "bool", ..., "global", "object", "persistent_id", "extension".
std::string_view KindName(Kind kind);

// How a kObject came to be, i.e. which opcode created it.
enum class Construction : uint8_t {
  kReduce,    // callable(*args)                         REDUCE
  kNewObj,    // cls.__new__(cls, *args)                 NEWOBJ
  kNewObjEx,  // cls.__new__(cls, *args, **kwargs)       NEWOBJ_EX
  kInst,      // INST module name + marked args; callable is a kGlobal
  kObj,       // OBJ: marked class + args
};

class Value;

// One change applied to a kObject after it was built, in pickle order.
struct Mutation {
  enum class Op : uint8_t {
    kAppend,   // APPEND / APPENDS: obj.append(first) (or extend), second is null
    kSetItem,  // SETITEM / SETITEMS: obj[first] = second
    kBuild,    // BUILD: obj.__setstate__(first) or obj.__dict__.update(first), second is null
  };
  Op op;
  Value* first;
  Value* second;
};

// One node. Accessors for a kind other than the node's own are programming errors (asserted);
// check kind() first or use the Is*/Get helpers, which return false/nullptr instead.
// Nodes are shared wherever the pickle shared them (torch's pids all point at one 'storage'
// and one 'cpu' str, tensors at one _rebuild_tensor_v2 global): changing a node in place changes
// every reference to it; to change one place only, point that place at a new node.
class Value {
  // Lets only Graph construct nodes, through std::deque's in-place construction.
  class Key {
    friend class Graph;
    Key() = default;
  };

 public:
  Value(Key, Kind kind) : kind_(kind) {}
  Value(const Value&) = delete;
  Value& operator=(const Value&) = delete;

  Kind kind() const { return kind_; }

  // Position of this node in its Graph's creation order, 0 .. Graph::size()-1; never changes.
  // Dense, so walkers keep per-node tables in vectors (NodeMap).
  size_t id() const { return id_; }

  // kBool.
  bool bool_value() const;

  // kInt: the value when it fits in int64.
  std::optional<int64_t> AsInt64() const;
  // kInt: the minimal little-endian two's-complement encoding (empty for 0), as LONG1 carries.
  std::string IntBytes() const;
  // kInt: base-10 text, e.g. "-12345678901234567890".
  std::string IntDecimal() const;

  // kFloat.
  double float_value() const;

  // kStr (UTF-8), kBytes, kByteArray: the payload.
  const std::string& data() const;
  std::string& mutable_data();

  // kTuple, kList, kSet, kFrozenSet: the elements.
  const std::vector<Value*>& items() const;
  std::vector<Value*>& mutable_items();
  // kTuple/kList: element i, or nullptr when out of range or not a tuple/list.
  Value* Item(size_t i) const;

  // kDict: the pairs, in order.
  const std::vector<std::pair<Value*, Value*>>& entries() const;
  std::vector<std::pair<Value*, Value*>>& mutable_entries();

  // kDict: the value of the last pair whose key is the str `key`; kObject: the same over its
  // kSetItem mutations (an OrderedDict). nullptr when absent or another kind.
  Value* Get(std::string_view key) const;

  // kGlobal.
  const std::string& module() const;
  const std::string& name() const;
  // True when this is kGlobal(module, name).
  bool IsGlobal(std::string_view module, std::string_view name) const;

  // kObject.
  Construction construction() const;
  Value* callable() const;  // the callable (kReduce) or class (others); never null
  Value* args() const;      // the argument tuple (kTuple); never null
  Value* kwargs() const;    // kNewObjEx: the kwargs dict; otherwise null
  void set_callable(Value* callable);
  void set_args(Value* args);
  const std::vector<Mutation>& mutations() const;
  std::vector<Mutation>& mutable_mutations();
  // kObject: the state of its last BUILD, or nullptr.
  Value* State() const;
  // True when this is a kObject whose callable is kGlobal(module, name), e.g.
  // IsCallOf("torch._utils", "_rebuild_tensor_v2").
  bool IsCallOf(std::string_view module, std::string_view name) const;

  // kPersistentId: the pid value.
  Value* pid() const;
  void set_pid(Value* pid);

  // kExtension: the registry code (1 .. 2^31-1).
  int32_t extension_code() const;

 private:
  friend class Graph;

  Kind kind_;
  size_t id_ = 0;
  Construction construction_ = Construction::kReduce;
  bool bool_ = false;
  bool int_is_big_ = false;  // int64_ is meaningless, data_ holds the two's-complement bytes
  int64_t int64_ = 0;        // kInt fast path; kExtension code
  double float_ = 0;
  std::string data_;  // str/bytes/bytearray payload; big int bytes; Global module
  std::string name_;  // Global name
  std::vector<Value*> items_;
  std::vector<std::pair<Value*, Value*>> entries_;
  Value* callable_ = nullptr;  // kObject callable; kPersistentId pid
  Value* args_ = nullptr;
  Value* kwargs_ = nullptr;
  std::vector<Mutation> mutations_;
};

// Owns every node of one pickle (or of one being built). Nodes are created only here and live
// as long as the Graph; their addresses are stable, also when the Graph is moved.
// Non-copyable, movable.
class Graph {
 public:
  Graph() = default;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  Graph(Graph&&) = default;
  Graph& operator=(Graph&&) = default;

  // The value the pickle's STOP returned (set by the unpickler); null in an empty Graph.
  Value* root() const { return root_; }
  void set_root(Value* root) { root_ = root; }
  // How many nodes this Graph owns.
  size_t size() const { return nodes_.size(); }

  // Factories. Arguments that are nodes must belong to this Graph.
  Value* None();
  Value* Bool(bool value);
  Value* Int(int64_t value);
  // From little-endian two's-complement bytes of any length (empty is 0); normalised, so a value
  // that fits in int64 takes the fast path.
  Value* IntFromBytes(std::string_view twos_complement_le);
  Value* Float(double value);
  // `utf8` must be UTF-8 (surrogates allowed); the pickler checks it when writing.
  Value* Str(std::string utf8);
  Value* Bytes(std::string bytes);
  Value* ByteArray(std::string bytes);
  Value* Tuple(std::vector<Value*> items);
  Value* List(std::vector<Value*> items);
  Value* Dict(std::vector<std::pair<Value*, Value*>> entries);
  Value* Set(std::vector<Value*> items);
  Value* FrozenSet(std::vector<Value*> items);
  Value* Global(std::string module, std::string name);
  // `args` must be a kTuple; `kwargs` a kDict for kNewObjEx and null otherwise.
  Value* Object(Construction construction, Value* callable, Value* args, Value* kwargs = nullptr);
  Value* PersistentId(Value* pid);
  Value* Extension(int32_t code);

  // Copies everything reachable from `root` (a node of any Graph, this one included) into this
  // Graph, keeping sharing and cycles; returns the copy of `root`.
  Value* Import(const Value* root);

 private:
  Value* Add(Kind kind);

  std::deque<Value> nodes_;  // a deque never moves its elements
  Value* root_ = nullptr;
};

// A per-node table for the nodes of one Graph, indexed by Value::id() and grown on demand;
// entries never set read as `fill`. Not for nodes of different Graphs (their ids collide).
template <typename T>
class NodeMap {
 public:
  explicit NodeMap(T fill = T()) : fill_(fill) {}

  T& operator[](const Value* v) {
    if (v->id() >= slots_.size()) slots_.resize(v->id() + 1, fill_);
    return slots_[v->id()];
  }

 private:
  T fill_;
  std::vector<T> slots_;
};

// Calls `visit` once for every node reachable from `root` (root first; an object's callable,
// args tuple, kwargs and mutation operands are its children), iteratively: safe on recursive
// and arbitrarily deep graphs. Stops at and returns the first non-OK Status `visit` returns.
Status ForEachReachable(Value* root, const std::function<Status(Value*)>& visit);

// A canonical text rendering used by tests and debug logs, defined so that an independent
// Python walker can produce the same string from the unpickled objects:
//   None True False | 12 -3 (base 10, any size) | f:<16 hex digits of the IEEE bits>
//   s"..." b"..." ba"..."   printable ASCII except " and \ as is, every other byte \xNN
//   (a, b)  [a, b]  {k: v, k2: v2}  set{...}  frozenset{...} (elements sorted by rendering)
//   g:module:name   ext:<code>   pid(<pid>)
//   call(<callable>, <args>) | new(<cls>, <args>) | new(<cls>, <args>, <kwargs>) (kwargs
//     only when non-empty)
//     followed by .append(x) .setitem(k, v) .build(state) for each mutation, in order;
//     kReduce, and kInst/kObj with non-empty args, render as call; kNewObj, kNewObjEx, and
//     kInst/kObj with empty args as new (what Python's unpickler does with them)
// Tuples print one trailing comma only for one element: (), (a,), (a, b).
// A non-empty tuple, list, dict, set, non-empty frozenset, bytearray, object or persistent id
// reached more than once is printed as #N=<value> the first time and #N after (N from 1 in
// order of first printing). Fails with kOutOfRange past kMaxDepth.
Result<std::string> Render(const Value* root);

}  // namespace ucp::pickle
